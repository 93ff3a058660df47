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
// With `gated` (W = gate | up, no bias) a CTA's lanes 0-15 read 16 of gate's columns and
// lanes 16-31 up's for the same outputs, and y [m, n / 2] gets silu(gate) * up (each
// rounded to x's dtype first, as silu_and_mul reads two products): grid N / 32 still.
//
// The normed entries (one row of x, the decode step of one sequence) also make x
// themselves: x = RMSNorm(x + residual) with weight gamma, what kernels/norm.py's
// rms_norm makes (its squares summed in another order), into shared memory by each CTA
// while the first block's weights are on their way (over_blocks' `first`), CTA 0
// storing x + residual to `summed`; the loop then reads x from there. That is the
// RMSNorm's launch, and its boundary, saved before a product (docs/benchmarks.md).
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_rows.ptx) is embedded and JIT-
// compiled by the driver at run time (native/decode_rows.cpp). After editing, run
// native/kernels/make_ptx.sh (needs nvcc) to regenerate that file.
#include <stdint.h>

#include "w4a16_ops.cuh"

namespace lmd_w4a16 {

constexpr int kColumns = 32;  // output columns a CTA

// The products' sums (rows_warp's acc) into y: each output once, the bias added, or with
// `gated` silu(gate) * up of lanes l and l + 16.
template <bool kBf16, int kTiles>
__device__ __forceinline__ void store_rows(const W4a16Rows& a, float* sums,
                                           const float (&acc)[kTiles][2][4]) {
  // Lane l's tile h holds columns 4 (l / 4) + 2h (d 0, 1) and 4 (l / 4) + 2h + 1 (d 2, 3).
  const auto column = [](int l, int h, int d) { return 4 * (l >> 2) + 2 * h + d / 2; };
  if (a.gated) {
    const int half = a.n / 2;
    sum_warps<kTiles, 16>(sums, acc, [&](int row, int l, int h, int d, float gate, float up) {
      if (row >= a.m) return;
      const int col = blockIdx.x * (kColumns / 2) + column(l, h, d);
      a.y[static_cast<size_t>(row) * half + col] = from_float<kBf16>(silu_mul<kBf16>(gate, up));
    });
    return;
  }
  sum_warps<kTiles>(sums, acc, [&](int row, int l, int h, int d, float v) {
    if (row >= a.m) return;
    const int col = blockIdx.x * kColumns + column(l, h, d);
    if (a.bias != nullptr) v += to_float<kBf16>(a.bias[col]);
    a.y[static_cast<size_t>(row) * a.n + col] = from_float<kBf16>(v);
  });
}

// A CTA's first column and how much further lanes 16-31 read theirs (rows_warp's `upper`).
__device__ __forceinline__ int2 cta_columns(const W4a16Rows& a) {
  if (a.gated) return make_int2(blockIdx.x * (kColumns / 2), a.n / 2 - kColumns / 2);
  return make_int2(blockIdx.x * kColumns, 0);
}

template <bool kBf16, int kTiles>
__device__ __forceinline__ void w4a16_rows(const W4a16Rows& a) {
  extern __shared__ float sums[];  // [warps][kTiles * 8][32]
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int2 cols = cta_columns(a);
  float acc[kTiles][2][4] = {};
  rows_warp<kBf16, kTiles>(
      a.q, a.s, a.z, a.n, a.k, cols.x,
      [&](int nt) {
        const int row = min(8 * nt + g, a.m - 1);  // past M: a real row, its outputs unstored
        return a.x + static_cast<size_t>(row) * a.x_stride + 4 * t;
      },
      threadIdx.x >> 5, blockDim.x >> 5, acc, cols.y);
  store_rows<kBf16, kTiles>(a, sums, acc);
}

// Eight 16-bit values (two a word) through f: value i becomes f(v's i, u's i), both as
// floats, rounded to the dtype.
template <bool kBf16, typename F>
__device__ __forceinline__ uint4 map8(uint4 v, uint4 u, const F& f) {
  uint32_t vs[4] = {v.x, v.y, v.z, v.w};
  const uint32_t us[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = from_float<kBf16>(f(to_float<kBf16>(vs[i] & 0xFFFFu),
                                            to_float<kBf16>(us[i] & 0xFFFFu)));
    const uint32_t hi = from_float<kBf16>(f(to_float<kBf16>(vs[i] >> 16),
                                            to_float<kBf16>(us[i] >> 16)));
    vs[i] = lo | (hi << 16);
  }
  return make_uint4(vs[0], vs[1], vs[2], vs[3]);
}

// x = RMSNorm(x + residual) into xs [k] (shared), a thread's kChunks chunks of eight
// inputs (k <= 8 kChunks threads: decode_rows.cpp checks) loaded at once, x, residual
// and gamma, so that the norm costs one round trip through L2: the sum rounded to the
// dtype (CTA 0 storing it to summed) and its squares; once the warps' squares (a float a
// warp in `scratch`) are added in warp order, x * rstd * gamma rounded. Every CTA sums in
// the same order, so all read the same x.
constexpr int kChunks = 4;
template <bool kBf16>
__device__ __forceinline__ void normed_row(const W4a16Rows& a, uint16_t* xs, float* scratch) {
  const auto words = [](const uint16_t* p, int i) {
    return load16(reinterpret_cast<const uint32_t*>(p + i));
  };
  uint4 v[kChunks], r[kChunks], g[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = 8 * (threadIdx.x + c * blockDim.x);
    if (i >= a.k) break;
    v[c] = words(a.x, i);
    g[c] = words(a.gamma, i);
    if (a.residual != nullptr) r[c] = words(a.residual, i);
  }
  float squares = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = 8 * (threadIdx.x + c * blockDim.x);
    if (i >= a.k) break;
    if (a.residual != nullptr) {
      v[c] = map8<kBf16>(v[c], r[c], [](float x, float y) { return x + y; });
      if (blockIdx.x == 0 && a.summed != nullptr) *reinterpret_cast<uint4*>(a.summed + i) = v[c];
    }
    const uint32_t vs[4] = {v[c].x, v[c].y, v[c].z, v[c].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x = to_float<kBf16>(j % 2 ? vs[j / 2] >> 16 : vs[j / 2] & 0xFFFFu);
      squares += x * x;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = squares;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += scratch[w];
  const float rstd = rsqrtf(total / static_cast<float>(a.k) + a.eps);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = 8 * (threadIdx.x + c * blockDim.x);
    if (i >= a.k) break;
    *reinterpret_cast<uint4*>(xs + i) =
        map8<kBf16>(v[c], g[c], [&](float x, float w) { return x * rstd * w; });
  }
  __syncthreads();
}

// One row, x normed by every CTA into shared memory (normed_row) while each warp's first
// block of words is in flight; the loop reads x from there, not ahead with the words.
template <bool kBf16>
__device__ __forceinline__ void w4a16_rows_normed(const W4a16Rows& a) {
  extern __shared__ float sums[];  // [warps][8][32], then x's row [k] in 16 bits
  uint16_t* xs = reinterpret_cast<uint16_t*>(sums + (blockDim.x >> 5) * 8 * 32);
  const int t = threadIdx.x & 3;
  const int2 cols = cta_columns(a);
  const int col = cols.x + 4 * ((threadIdx.x & 31) >> 2) + ((threadIdx.x & 31) >= 16 ? cols.y : 0);
  uint32_t mask = 0x000F000Fu;  // in registers, as rows_warp keeps them
  uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
  asm("" : "+r"(mask), "+r"(magic));
  float acc[1][2][4] = {};
  over_blocks<WordsBlock>(
      threadIdx.x >> 5, blockDim.x >> 5, a.k / 128,
      [&](WordsBlock& b, int kb) { b.load(a.q, a.s, a.z, a.n, kb, t, col); },
      [&](const WordsBlock& b, int kb) {
        const uint2* x = reinterpret_cast<const uint2*>(xs + 128 * kb + 4 * t);
        const auto step_b = [&](int j, int, uint2 (&bx)[1]) { bx[0] = x[4 * j]; };
        multiply_steps<kBf16, 1, 1>(b.w, b.s, b.z, mask, magic, step_b, acc);
      },
      [&] { normed_row<kBf16>(a, xs, sums); });
  store_rows<kBf16, 1>(a, sums, acc);
}

}  // namespace lmd_w4a16

LMD_ROWS_ENTRIES(lmd_w4a16_rows, W4a16Rows, lmd_w4a16::w4a16_rows)

#define LMD_NORMED_ENTRY(dtype, bf16)                                                \
  extern "C" __global__ void __launch_bounds__(512)                                  \
      lmd_w4a16_rows_normed_##dtype##_m1(const W4a16Rows a) {                        \
    lmd_w4a16::w4a16_rows_normed<bf16>(a);                                           \
  }
LMD_NORMED_ENTRY(bf16, true)
LMD_NORMED_ENTRY(f16, false)
