// FP8 (e4m3) product for the few rows of a decode step: y = x W^T (+ b), x [M <= 16, K]
// in bf16 or fp16, W [N, K] e4m3 (row-major, K contiguous) with float32 scales per output
// channel ([N]) or per 128 x 128 block ([ceil(N / 128), K / 128], row stride s_stride),
// as daemon/engine/turbo/quant/fp8.py holds them.
//
// Tensor cores, one mma.sync.m16n8k16 in fp16 per 16 inputs: W is the 16 x 16 A operand
// (16 output columns by 16 inputs), x the 16 x 8 B operand (a row of x per column of B;
// columns past M repeat row M - 1, their outputs never stored). Two e4m3 codes become an
// fp16 pair in one instruction (cvt.rn.f16x2.e4m3x2, exact: e4m3 is a subset of fp16), so
// x is taken in fp16 too: bf16 x is converted as it is loaded, saturating at fp16's
// largest (65504; bf16 values that large do not come out of a norm or an activation), and
// its values under 2^-14 lose bits as fp16 subnormals (terms too small to move a sum).
//
// A CTA is 32 output columns by all of K. A lane (g, t) of a warp holds four columns, g,
// g + 8 (rows g, g + 8 of A tile 0) and 16 + g, 24 + g (tile 1), and of each a block of
// 128 inputs the bytes 64 i + 16 t .. + 15 for i = 0, 1: two 16-byte loads, four lanes a
// row covering 64 bytes (two whole sectors) a load. The inputs of an mma step may be
// taken in any order as long as A and B agree: step j = 4 i + w takes word w of those 16
// bytes, inputs 64 i + 16 t + 4 w .. + 3, which are A's columns 2t, 2t+1 (low half of
// the word) and 2t+8, 2t+9 (high half) and B's rows of the same numbers, x's four inputs
// there (an 8-byte piece of the lane's x loads).
//
// The WARPS warps of a CTA take every WARPS-th block of K, loading the next block (W and
// x) into registers while they multiply the current one (two sets in turn, as
// w4a16_rows.cu). A block's products are summed in float32 by the tensor cores and added
// to the lane's sums times the block's scale (1 for per-channel weights); the warps' sums
// meet in shared memory, are added in warp order (deterministic) and scaled by the
// column's scale. Nothing is synchronized with the host: decode steps capture it in their
// CUDA graphs.
//
// Not compiled by setup.py: its PTX (native/kernels/fp8_rows.ptx) is embedded and JIT-
// compiled by the driver at run time (native/decode_rows.cpp). After editing, run
// native/kernels/make_ptx.sh (needs nvcc) to regenerate that file.
#include <stdint.h>

#include "w4a16_ops.cuh"

struct Fp8Rows {
  const uint16_t* x;     // [m, k], row stride x_stride elements; 16-byte aligned rows
  const uint8_t* w;      // [n, k] e4m3, row stride k
  const float* s;        // [n] per channel, or [ceil(n / 128), k / 128] (s_stride > 0)
  const uint16_t* bias;  // [n] or null
  uint16_t* y;           // [m, n]
  int m, n, k, x_stride, s_stride;  // s_stride 0: per-channel scales
  int pad;
};

namespace lmd_fp8 {

using lmd_w4a16::lane_of;
using lmd_w4a16::load16;
using lmd_w4a16::mma;
using lmd_w4a16::over_blocks;
using lmd_w4a16::store_sums;

constexpr int kColumns = 32;  // output columns a CTA

// One block of 128 inputs as a lane holds it: for each of its columns c (h, r: tile h,
// row g + 8 r) bytes 64 i + 16 t .. + 15; for each x tile its row's 16-bit inputs at the
// same places (two 16-byte loads an i).
template <int kTiles>
struct Block {
  uint4 w[2][2][2];          // [h][r][i]
  uint4 x[kTiles][2][2];     // [tile][i][half of the 16 inputs]
};

template <int kTiles>
__device__ __forceinline__ void load_block(Block<kTiles>& b, const Fp8Rows& a, int kb, int g,
                                           int t) {
  const int offset = 128 * kb + 16 * t;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int col = blockIdx.x * kColumns + 16 * h + 8 * r + g;
      const uint8_t* w = a.w + static_cast<size_t>(col) * a.k + offset;
#pragma unroll
      for (int i = 0; i < 2; ++i) b.w[h][r][i] = load16(reinterpret_cast<const uint32_t*>(w + 64 * i));
    }
  }
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    const int row = min(8 * nt + g, a.m - 1);  // past M: a real row, its outputs unstored
    const uint16_t* x = a.x + static_cast<size_t>(row) * a.x_stride + offset;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        b.x[nt][i][half] = load16(reinterpret_cast<const uint32_t*>(x + 64 * i + 8 * half));
      }
    }
  }
}

// Two e4m3 codes (the low and high byte of `pair`) -> an fp16 pair, exactly.
__device__ __forceinline__ uint32_t e4m3_pair(uint32_t pair) {
  uint32_t d;
  const uint16_t codes = static_cast<uint16_t>(pair);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(codes));
  return d;
}

// A pair of x's 16-bit inputs -> an fp16 pair (bf16: converted, saturating).
template <bool kBf16>
__device__ __forceinline__ uint32_t x_pair(uint32_t v) {
  if (!kBf16) return v;
  const float lo = __uint_as_float(v << 16);
  const float hi = __uint_as_float(v & 0xFFFF0000u);
  uint32_t d;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// acc[nt][h][d] += scale * (a block's products): tile h's mma output d (d 0, 1: column
// 16 h + g at x rows 8 nt + 2t, +1; d 2, 3: column 16 h + 8 + g).
template <bool kBf16, int kTiles>
__device__ __forceinline__ void multiply_block(const Block<kTiles>& b, float scale,
                                               float (&acc)[kTiles][2][4]) {
  float part[kTiles][2][4] = {};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t a[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t low_row = lane_of(b.w[h][0][i], w);  // column 16 h + g
        const uint32_t high_row = lane_of(b.w[h][1][i], w);  // column 16 h + 8 + g
        a[h][0] = e4m3_pair(low_row);
        a[h][1] = e4m3_pair(high_row);
        a[h][2] = e4m3_pair(low_row >> 16);
        a[h][3] = e4m3_pair(high_row >> 16);
      }
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) {
        const uint4& xs = b.x[nt][i][w / 2];
        uint2 bx;
        bx.x = x_pair<kBf16>(lane_of(xs, 2 * (w % 2)));
        bx.y = x_pair<kBf16>(lane_of(xs, 2 * (w % 2) + 1));
        mma<false>(part[nt][0], a[0], bx);
        mma<false>(part[nt][1], a[1], bx);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int d = 0; d < 4; ++d) acc[nt][h][d] += scale * part[nt][h][d];
    }
  }
}

template <bool kBf16, int kTiles>
__device__ __forceinline__ void fp8_rows(const Fp8Rows& a) {
  extern __shared__ float sums[];  // [warps][kTiles * 8][32]
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int blocks = a.k / 128;
  // A block's scale: its 128 x 128 block's (a CTA's 32 columns lie in one), else 1.
  const float* block_scales =
      a.s_stride ? a.s + static_cast<size_t>(blockIdx.x * kColumns / 128) * a.s_stride : nullptr;

  float acc[kTiles][2][4] = {};
  over_blocks<Block<kTiles>>(
      warp, warps, blocks, [&](Block<kTiles>& b, int kb) { load_block(b, a, kb, g, t); },
      [&](const Block<kTiles>& b, int kb) {
        multiply_block<kBf16>(b, block_scales ? block_scales[kb] : 1.0f, acc);
      });
  // Lane (g, ...)'s tile h holds columns 16 h + g (d 0, 1) and 16 h + 8 + g (d 2, 3).
  store_sums<kBf16, kTiles>(
      sums, acc, a.m, a.n, a.bias, a.y,
      [&](int l, int h, int d) { return blockIdx.x * kColumns + 16 * h + 8 * (d / 2) + (l >> 2); },
      [&](float v, int n) { return a.s_stride ? v : v * a.s[n]; });
}

}  // namespace lmd_fp8

LMD_ROWS_ENTRIES(lmd_fp8_rows, Fp8Rows, lmd_fp8::fp8_rows)
