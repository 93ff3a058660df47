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
// A CTA (w4a16_ops.cuh rows_cta) is 32 columns by all of K, its WARPS warps taking every
// WARPS-th block of K, loading the next block (words, x, scales, zeros) into registers
// while they multiply the current one (two sets of registers in turn: a copy between them
// was 35 SELs a block); the warps' sums meet in shared memory and are added in warp order
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

template <bool kBf16, int kTiles>
__device__ __forceinline__ void w4a16_rows(const W4a16Rows& a) {
  extern __shared__ float sums[];  // [warps][kTiles * 8][32]
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  rows_cta<kBf16, kTiles>(
      a.q, a.s, a.z, a.n, a.k, blockIdx.x * kColumns,
      [&](int nt) {
        const int row = min(8 * nt + g, a.m - 1);  // past M: a real row, its outputs unstored
        return a.x + static_cast<size_t>(row) * a.x_stride + 4 * t;
      },
      sums,
      [&](int row, int l, int h, int d, float v) {
        // Lane l's tile h holds columns 4 (l / 4) + 2h (d 0, 1) and 4 (l / 4) + 2h + 1 (d 2, 3).
        const int col = blockIdx.x * kColumns + 4 * (l >> 2) + 2 * h + d / 2;
        if (row >= a.m) return;
        if (a.bias != nullptr) v += to_float<kBf16>(a.bias[col]);
        a.y[static_cast<size_t>(row) * a.n + col] = from_float<kBf16>(v);
      });
}

}  // namespace lmd_w4a16

LMD_ROWS_ENTRIES(lmd_w4a16_rows, W4a16Rows, lmd_w4a16::w4a16_rows)
