// W4A16 mixture-of-experts products for decode steps' few rows an expert: for every
// (token, choice) pair p of a block, y[p] = x[p / row_div] W_e^T (* weights[p]), W_e the
// block's expert's 4-bit weights. The pairs come sorted by expert and padded to blocks of
// 8 or 16 rows, each block one expert's (daemon/engine/turbo/kernels/moe_align.py); pair
// ids of num_pairs are padding. Without the sorted ids (one token's pairs, whose experts
// are distinct) block b holds pair b alone. The experts are W4A16Weights stacked
// (daemon/engine/turbo/quant/w4a16_experts.py):
//
//     qweight [E, K / 8, N] int32, scales [E, K / 128, N] (x's dtype), zeros [E, K / 128,
//     N] uint8; expert e's slices are w4a16_rows.cu's layout
//
// A CTA is w4a16_rows.cu's for one block (w4a16_ops.cuh rows_cta): 32 output columns of
// its expert by all of K, its warps taking every warps-th block of 128 inputs, exact
// products summed in float32, each group's sum scaled once. What differs: x's rows are
// the block's pairs' rows (padding rows read the block's first pair's row, always a real
// one, and are not stored), the weights are the block's expert's, and the sums of row p
// go to y's row p, times its routing weight when weights are given. With `gated` (W_e
// gate | up, no weights) a CTA's lanes 0-15 read 16 of gate's columns and lanes 16-31
// up's for the same outputs, and y [P, N / 2] gets silu(gate) * up, each product rounded
// to x's dtype first as silu_and_mul reads them. Grid: N / 32 x the blocks; a block of
// expert -1 (past the last expert's run) returns at once. With `mixed` (one token's
// pairs, no sorted ids, routing weights, 8 rows, one block) a CTA owns 16 columns, its
// warps two pairs each in turn (w4a16_mixed), warps / ceil(num_pairs / 2) of them
// splitting K, and y [1, N] gets the token's mix: the sum over pairs, in pair order in
// float32 and rounded once, of each pair's product times its weight rounded to x's dtype
// (what the products and a sum over them give, in one launch; grid N / 16). Nothing is
// synchronized with the host: decode steps capture it in their CUDA graphs.
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_experts.ptx) is embedded and
// JIT-compiled by the driver at run time (native/decode_rows.cpp). After editing, run
// native/kernels/make_ptx.sh (needs nvcc) to regenerate that file.
#include <stdint.h>

#include "w4a16_ops.cuh"

namespace lmd_w4a16 {

constexpr int kExpertColumns = 32;  // output columns a CTA

// `mixed`: one token's pairs two a warp, 16 columns a CTA: lanes 0-15 multiply pair 2j's
// expert's columns by x row 0 (pair 2j's), lanes 16-31 pair 2j + 1's same columns
// (rows_warp's `upper` -16) by x row 1 (pair 2j + 1's); warps j per .. j per + per - 1
// split K. An odd count's last lanes 16-31 read pair 2j again (not stored).
template <bool kBf16>
__device__ __forceinline__ void w4a16_mixed(const W4a16Experts& a) {
  extern __shared__ float sums[];  // [warps][8][32]
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int per = (blockDim.x >> 5) / ((a.num_pairs + 1) / 2);  // warps a two pairs
  const int first = 2 * (warp / per);
  const auto pair_or_first = [&](int p) { return p < a.num_pairs ? p : first; };
  const int mine = pair_or_first(first + (lane >> 4));  // the pair whose weights it reads
  const size_t groups = static_cast<size_t>(a.experts[mine]) * (a.k / 128) * a.n;
  const int row = pair_or_first(first + ((lane >> 2) == 1));  // x row g: 1 the second pair's
  const uint16_t* x = a.x + static_cast<size_t>(row / a.row_div) * a.x_stride + 4 * (lane & 3);
  const int col0 = blockIdx.x * (kExpertColumns / 2);
  float acc[1][2][4] = {};
  rows_warp<kBf16, 1>(a.q + 16 * groups, a.s + groups, a.z + groups, a.n, a.k, col0,
                      [&](int) { return x; }, warp % per, per, acc, -kExpertColumns / 2);
  stash_sums<1>(sums, acc);
  if (threadIdx.x >= kExpertColumns / 2) return;
  // Column c: lane 4 (c / 4) (+ 16 for the second pair), tile h = c % 4 / 2, output d =
  // 2 (c % 2) at x row 0 (d + 1 at row 1 for the second pair).
  const int c = threadIdx.x;
  const int e = 4 * ((c & 3) >> 1) + 2 * (c & 1);
  float mix = 0.0f;
  for (int p = 0; p < a.num_pairs; ++p) {
    const float v = warp_sum<8>(sums, e + (p & 1), 4 * (c >> 2) + 16 * (p & 1), p / 2 * per,
                                (p / 2 + 1) * per);
    mix += to_float<kBf16>(from_float<kBf16>(v * a.weights[p]));
  }
  a.y[col0 + c] = from_float<kBf16>(mix);
}

template <bool kBf16, int kTiles>
__device__ __forceinline__ void w4a16_experts(const W4a16Experts& a) {
  if constexpr (kTiles == 1) {
    if (a.mixed) return w4a16_mixed<kBf16>(a);
  }
  extern __shared__ float sums[];  // [warps][kTiles * 8][32]
  constexpr int kRows = 8 * kTiles;
  const int expert = a.experts[blockIdx.y];
  if (expert < 0) return;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int32_t* pairs = a.pairs + static_cast<size_t>(blockIdx.y) * kRows;
  const auto pair_at = [&](int slot) {  // the pair in the block's row `slot`
    if (a.pairs != nullptr) return pairs[slot];
    return slot == 0 ? static_cast<int>(blockIdx.y) : a.num_pairs;
  };
  const int first = pair_at(0);
  const uint16_t* x_rows[kTiles];  // the lane's rows 8 nt + g of the block, at input 4t
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    const int pair = pair_at(8 * nt + g);
    const int row = (pair < a.num_pairs ? pair : first) / a.row_div;
    x_rows[nt] = a.x + static_cast<size_t>(row) * a.x_stride + 4 * t;
  }
  const size_t groups = static_cast<size_t>(expert) * (a.k / 128) * a.n;  // [K / 128, N] each
  const uint32_t* q = a.q + 16 * groups;
  const auto x_row = [&](int nt) { return x_rows[nt]; };
  // Lane l's tile h holds columns 4 (l / 4) + 2h (d 0, 1) and 4 (l / 4) + 2h + 1 (d 2, 3).
  const auto column = [](int l, int h, int d) { return 4 * (l >> 2) + 2 * h + d / 2; };
  if (a.gated) {  // lanes 0-15: gate's 16 columns of 16 outputs; 16-31: up's, n / 2 on
    const int half = a.n / 2;
    rows_cta<kBf16, kTiles, 16>(
        q, a.s + groups, a.z + groups, a.n, a.k, blockIdx.x * (kExpertColumns / 2), x_row, sums,
        [&](int row, int l, int h, int d, float gate, float up) {
          const int pair = pair_at(row);
          if (pair >= a.num_pairs) return;
          const float v = silu_mul<kBf16>(gate, up);
          const int out = blockIdx.x * (kExpertColumns / 2) + column(l, h, d);
          a.y[static_cast<size_t>(pair) * half + out] = from_float<kBf16>(v);
        },
        half - kExpertColumns / 2);
    return;
  }
  rows_cta<kBf16, kTiles>(
      q, a.s + groups, a.z + groups, a.n, a.k, blockIdx.x * kExpertColumns, x_row, sums,
      [&](int row, int l, int h, int d, float v) {
        const int pair = pair_at(row);
        if (pair >= a.num_pairs) return;
        if (a.weights != nullptr) v *= a.weights[pair];
        a.y[static_cast<size_t>(pair) * a.n + blockIdx.x * kExpertColumns + column(l, h, d)] =
            from_float<kBf16>(v);
      });
}

}  // namespace lmd_w4a16

LMD_ROWS_ENTRIES(lmd_w4a16_experts, W4a16Experts, lmd_w4a16::w4a16_experts)
