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
// A CTA is w4a16_rows.cu's for one block: 32 output columns of its expert by all of K, its
// warps taking every warps-th block of 128 inputs, the tensor-core steps and the
// conversions of w4a16_ops.cuh, exact products summed in float32, each group's sum scaled
// once. What differs: x's rows are the block's pairs' rows (padding rows read the block's
// first pair's row, always a real one, and are not stored), the weights are the block's
// expert's, and the sums of row p go to y's row p, times its routing weight when weights
// are given. Grid: N / 32 x the blocks; a block of expert -1 (past the last expert's run)
// returns at once. Nothing is synchronized with the host: decode steps capture it in
// their CUDA graphs.
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_experts.ptx) is embedded and
// JIT-compiled by the driver at run time (native/decode_rows.cpp). After editing, run
// native/kernels/make_ptx.sh (needs nvcc) to regenerate that file.
#include <stdint.h>

#include "w4a16_ops.cuh"

struct W4a16Experts {
  const uint16_t* x;       // [rows, k], row stride x_stride elements; 8-byte aligned rows
  const uint32_t* q;       // [E, k / 8, n]
  const uint16_t* s;       // [E, k / 128, n]
  const uint8_t* z;        // [E, k / 128, n]
  const int32_t* pairs;    // [blocks * block rows] pair ids sorted by expert; null: block
                           // b holds pair b alone (one token's pairs, experts distinct)
  const int32_t* experts;  // [blocks] the expert of each block, -1 for none
  const float* weights;    // [num_pairs] routing weights, or null
  uint16_t* y;             // [num_pairs, n]
  int n, k, x_stride, num_pairs, row_div, pad;
};

namespace lmd_w4a16 {

constexpr int kExpertColumns = 32;  // output columns a CTA

// One block of 128 inputs as a lane holds it (w4a16_rows.cu's Block).
template <int kTiles>
struct ExpertBlock {
  uint4 w[4];
  uint2 x[kTiles][8];
  uint2 s;
  uint32_t z;
};

template <bool kBf16, int kTiles>
__device__ __forceinline__ void w4a16_experts(const W4a16Experts& a) {
  extern __shared__ float sums[];  // [warps][kTiles * 8][32]
  constexpr int kRows = 8 * kTiles;
  const int expert = a.experts[blockIdx.y];
  if (expert < 0) return;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int col = blockIdx.x * kExpertColumns + 4 * g;
  const int blocks = a.k / 128;
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
  const size_t groups = static_cast<size_t>(expert) * blocks * a.n;  // the expert's [K/128, N]
  const uint32_t* q_expert = a.q + 16 * groups;
  // In registers, not immediates (see and_or); the loop keeps them.
  uint32_t mask = 0x000F000Fu;
  uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
  asm("" : "+r"(mask), "+r"(magic));

  float acc[kTiles][2][4] = {};
  over_blocks<ExpertBlock<kTiles>>(
      warp, warps, blocks,
      [&](ExpertBlock<kTiles>& b, int kb) {
        const uint32_t* q = q_expert + static_cast<size_t>(16 * kb + 4 * t) * a.n + col;
#pragma unroll
        for (int i = 0; i < 4; ++i) b.w[i] = load16(q + static_cast<size_t>(i) * a.n);
#pragma unroll
        for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
          for (int j = 0; j < 8; ++j) b.x[nt][j] = load8(x_rows[nt] + 128 * kb + 16 * j);
        }
        const size_t at = groups + static_cast<size_t>(kb) * a.n + col;
        b.s = load8(a.s + at);
        b.z = load4(a.z + at);
      },
      [&](const ExpertBlock<kTiles>& b, int) {
        const auto step_b = [&](int j, int nt, uint2 (&bx)[1]) { bx[0] = b.x[nt][j]; };
        multiply_steps<kBf16, kTiles, 1>(b.w, b.s, b.z, mask, magic, step_b, acc);
      });

  // The warps' sums added in warp order (deterministic), as store_sums does, each row
  // stored at its pair's row of y.
  constexpr int kSums = kTiles * 8;
  const float* flat = &acc[0][0][0];
#pragma unroll
  for (int e = 0; e < kSums; ++e) sums[(warp * kSums + e) * 32 + lane] = flat[e];
  __syncthreads();
  for (int i = threadIdx.x; i < kSums * 32; i += blockDim.x) {
    const int e = i / 32;
    const int l = i % 32;
    const int d = e % 4;
    const int pair = pair_at(8 * (e / 8) + 2 * (l & 3) + (d & 1));
    if (pair >= a.num_pairs) continue;
    float v = 0.0f;
    for (int w = 0; w < warps; ++w) v += sums[(w * kSums + e) * 32 + l];
    if (a.weights != nullptr) v *= a.weights[pair];
    // Lane l's tile h holds columns 4 (l / 4) + 2h (d 0, 1) and 4 (l / 4) + 2h + 1 (d 2, 3).
    const int column = blockIdx.x * kExpertColumns + 4 * (l >> 2) + 2 * ((e / 4) % 2) + d / 2;
    a.y[static_cast<size_t>(pair) * a.n + column] = from_float<kBf16>(v);
  }
}

}  // namespace lmd_w4a16

LMD_ROWS_ENTRIES(lmd_w4a16_experts, W4a16Experts, lmd_w4a16::w4a16_experts)
