// W4A16 product for the few rows of a decode step: y = x W^T (+ b), x [M <= 16, K] in
// bf16 or fp16, W 4-bit in groups of 128 inputs, in the layout of
// daemon/engine/turbo/quant/w4a16.py:
//
//     qweight [K / 8, N] int32: word (16 b + r, n) holds q[n, 128 b + 16 j + r] in bits 4 j
//     scales [K / 128, N] (x's dtype), zeros [K / 128, N] uint8; W = (q - zero) * scale
//
// Tensor cores, one mma.sync.m16n8k16 per 16 inputs: W is the 16 x 16 A operand (16
// output columns by 16 inputs), x the 16 x 8 B operand (a row of x per column of B;
// columns past M repeat row M - 1, and their outputs are not stored). The inputs of a
// step may be taken in any order as long as A and B agree, so step j of a block takes nibble j of the block's 16 word rows, and A's input column
// kappa is word row r(kappa): lane (g, t) of the warp holds A's columns 2t, 2t+1, 2t+8,
// 2t+9, mapped to word rows 4t .. 4t+3, and B's matching rows are x's four consecutive
// inputs 16 j + 4t .. 4t+3 (one 8-byte load). A's rows g and g+8 may likewise be any two
// output columns: a warp covers 32 columns, lane (g, ...) the four columns 4g .. 4g+3 (two
// 16-row tiles: rows g, g+8 of the first are columns 4g, 4g+1, of the second 4g+2,
// 4g+3), so each word row of the warp's tile is one 16-byte load per lane, 128 bytes per
// eight lanes. A block of 128 inputs is then 4 loads a lane (2 KB a warp) and makes 8
// steps of two A tiles.
//
// The codes become operands as w4a16_ops.cuh says. The tensor cores sum a block's (a
// group's) products in float32; the sum is scaled in float32. Exact products, so this
// agrees with the float32 product of the dequantized weights to float32 rounding.
//
// A CTA is 32 columns by all of K, its WARPS warps taking every WARPS-th block of K,
// loading the next block (words, x, scales, zeros) into registers while they multiply
// the current one (two sets of registers in turn: a copy between them was 35 SELs a
// block); the warps' sums meet in shared memory and are added in warp order
// (deterministic). Grid: N / 32 CTAs. The kernel is bound by its integer instructions
// (half-rate on the multiprocessor), not by bytes in flight: a ring of 2-6 blocks through
// cp.async and shared memory was 30-40% slower, an L2 prefetch no faster. Hence the
// lop3 with both constants in registers (one instruction an operand, not two) and x's
// rows past M loaded from row M - 1 (their products land in columns never stored), not
// selected to zero. Nothing is synchronized with the host: decode steps capture it in
// their CUDA graphs.
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_rows.ptx) is embedded and JIT-
// compiled by the driver at run time (native/decode_rows.cpp). After editing, run
// native/kernels/make_ptx.sh (needs nvcc) to regenerate that file.
#include <stdint.h>

#include "w4a16_ops.cuh"

struct W4a16Rows {
  const uint16_t* x;     // [m, k], row stride x_stride elements; 8-byte aligned rows
  const uint32_t* q;     // [k / 8, n]
  const uint16_t* s;     // [k / 128, n]
  const uint8_t* z;      // [k / 128, n]
  const uint16_t* bias;  // [n] or null
  uint16_t* y;           // [m, n]
  int m, n, k, x_stride;
};

namespace lmd_w4a16 {

constexpr int kColumns = 32;  // output columns a CTA

// One block of 128 inputs as a lane holds it: word rows 4t .. 4t+3 at its 4 columns, its
// x rows' inputs 16 j + 4t .. 4t+3 for each step j, and its columns' scales and zeros.
template <int kTiles>
struct Block {
  uint4 w[4];
  uint2 x[kTiles][8];
  uint2 s;
  uint32_t z;
};

template <int kTiles>
__device__ __forceinline__ void load_block(Block<kTiles>& b, const W4a16Rows& a,
                                           int kb, int col, int g, int t) {
  const uint32_t* q = a.q + static_cast<size_t>(16 * kb + 4 * t) * a.n + col;
#pragma unroll
  for (int i = 0; i < 4; ++i) b.w[i] = load16(q + static_cast<size_t>(i) * a.n);
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    const int row = min(8 * nt + g, a.m - 1);  // past M: a real row, its outputs unstored
    const uint16_t* x = a.x + static_cast<size_t>(row) * a.x_stride + 128 * kb + 4 * t;
#pragma unroll
    for (int j = 0; j < 8; ++j) b.x[nt][j] = load8(x + 16 * j);
  }
  const size_t at = static_cast<size_t>(kb) * a.n + col;
  b.s = load8(a.s + at);
  b.z = load4(a.z + at);
}

template <bool kBf16, int kTiles>
__device__ __forceinline__ void multiply_block(const Block<kTiles>& b, uint32_t mask,
                                               uint32_t magic, float (&acc)[kTiles][2][4]) {
  const auto step_b = [&](int j, int nt, uint2 (&bx)[1]) { bx[0] = b.x[nt][j]; };
  multiply_steps<kBf16, kTiles, 1>(b.w, b.s, b.z, mask, magic, step_b, acc);
}

template <bool kBf16, int kTiles>
__device__ __forceinline__ void w4a16_rows(const W4a16Rows& a) {
  extern __shared__ float sums[];  // [warps][kTiles * 8][32]
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int col = blockIdx.x * kColumns + 4 * g;
  const int blocks = a.k / 128;
  // In registers, not immediates (see and_or); the loop keeps them.
  uint32_t mask = 0x000F000Fu;
  uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
  asm("" : "+r"(mask), "+r"(magic));

  float acc[kTiles][2][4] = {};
  over_blocks<Block<kTiles>>(
      warp, warps, blocks,
      [&](Block<kTiles>& b, int kb) { load_block(b, a, kb, col, g, t); },
      [&](const Block<kTiles>& b, int) { multiply_block<kBf16>(b, mask, magic, acc); });
  // Lane (g, ...)'s tile h holds columns 4g + 2h (d 0, 1) and 4g + 2h + 1 (d 2, 3).
  store_sums<kBf16, kTiles>(
      sums, acc, a.m, a.n, a.bias, a.y,
      [&](int l, int h, int d) { return blockIdx.x * kColumns + 4 * (l >> 2) + 2 * h + d / 2; },
      [](float v, int) { return v; });
}

}  // namespace lmd_w4a16

LMD_ROWS_ENTRIES(lmd_w4a16_rows, W4a16Rows, lmd_w4a16::w4a16_rows)
