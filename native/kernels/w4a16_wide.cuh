// The shared part of the W4A16 kernels for 17-64 rows: w4a16_wide.cu (mma.sync, any
// GPU from sm_80) and w4a16_wgmma.cu (wgmma, Hopper). Both are a CTA of 4 warps side by
// side (128 output columns, one warpgroup), x staged a block of 128 inputs at a time
// through shared memory by cp.async, K split over CTAs; they differ in how the tensor
// cores are fed. What is here: the kernel's parameter, a lane's load of a block's
// weights, and the end of a CTA (its sums to y, or to the work of its split, the last
// CTA of a span adding the splits in order).
#pragma once

#include <stdint.h>

#include "w4a16_ops.cuh"

struct W4a16Wide {
  const uint16_t* x;     // [m, k], row stride x_stride elements; 16-byte aligned rows
  const uint32_t* q;     // [k / 8, n]
  const uint16_t* s;     // [k / 128, n]
  const uint8_t* z;      // [k / 128, n]
  const uint16_t* bias;  // [n] or null
  uint16_t* y;           // [m, n]
  float* work;           // [splits, m, n] when splits > 1
  unsigned* counters;    // [n / 128 rounded up], zero between launches
  int m, n, k, x_stride, splits;
};

namespace lmd_w4a16 {

constexpr int kWarps = 4;
constexpr int kSpan = 32 * kWarps;  // output columns a CTA

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t to, const void* from) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(from));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

__device__ __forceinline__ void wait_all_but_one() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}

__device__ __forceinline__ float4 load_cg(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}

// A lane's share of a block's weights: word rows 2t, 2t+1, 2t+8, 2t+9 at its 4 columns,
// and their scales and zeros.
struct Weights {
  uint4 w[4];
  uint2 s;
  uint32_t z;
};

__device__ __forceinline__ void load_weights(Weights& b, const W4a16Wide& a, int kb, int col,
                                             int t) {
  const size_t n = static_cast<size_t>(a.n);
  const uint32_t* q = a.q + (16 * static_cast<size_t>(kb) + 2 * t) * n + col;
  b.w[0] = load16(q);
  b.w[1] = load16(q + n);
  b.w[2] = load16(q + 8 * n);
  b.w[3] = load16(q + 9 * n);
  const size_t at = static_cast<size_t>(kb) * n + col;
  b.s = load8(a.s + at);
  b.z = load4(a.z + at);
}

template <bool kBf16>
__device__ __forceinline__ uint2 pack4(float a, float b, float c, float d) {
  return make_uint2(from_float<kBf16>(a) | (static_cast<uint32_t>(from_float<kBf16>(b)) << 16),
                    from_float<kBf16>(c) | (static_cast<uint32_t>(from_float<kBf16>(d)) << 16));
}

template <bool kBf16>
__device__ __forceinline__ float4 plus_bias(float4 v, const W4a16Wide& a, int col) {
  if (a.bias == nullptr) return v;
  const uint2 b = load8(a.bias + col);
  return make_float4(v.x + to_float<kBf16>(b.x & 0xFFFFu), v.y + to_float<kBf16>(b.x >> 16),
                     v.z + to_float<kBf16>(b.y & 0xFFFFu), v.w + to_float<kBf16>(b.y >> 16));
}

__device__ __forceinline__ void store8(uint16_t* p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// The last CTA of a span: y = the splits' sums in split order (+ bias).
template <bool kBf16>
__device__ __forceinline__ void sum_splits(const W4a16Wide& a, int span) {
  for (int e = threadIdx.x; e < a.m * (kSpan / 4); e += 32 * kWarps) {
    const int row = e / (kSpan / 4);
    const int col = span * kSpan + 4 * (e % (kSpan / 4));
    if (col >= a.n) continue;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int sp = 0; sp < a.splits; ++sp) {
      const float4 p = load_cg(a.work + (static_cast<size_t>(sp) * a.m + row) * a.n + col);
      v = make_float4(v.x + p.x, v.y + p.y, v.z + p.z, v.w + p.w);
    }
    v = plus_bias<kBf16>(v, a, col);
    store8(a.y + static_cast<size_t>(row) * a.n + col, pack4<kBf16>(v.x, v.y, v.z, v.w));
  }
}

// The end of a CTA: acc[nt][h][d] is tile h's column 4g + 2h + d / 2 for x row 8 nt + 2t +
// d % 2 (the mma.sync and wgmma accumulators alike), so a lane holds, for x row 8 nt + 2t
// + e, columns col .. col + 3. `last` is a shared flag.
template <bool kBf16, int kTiles>
__device__ __forceinline__ void finish(const W4a16Wide& a, const float (&acc)[kTiles][2][4],
                                       int span, int col, bool stores, int t, bool* last) {
  if (a.splits == 1) {
    if (!stores) return;
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = 8 * nt + 2 * t + e;
        if (row >= a.m) continue;
        const float4 v = plus_bias<kBf16>(
            make_float4(acc[nt][0][e], acc[nt][0][2 + e], acc[nt][1][e], acc[nt][1][2 + e]), a,
            col);
        store8(a.y + static_cast<size_t>(row) * a.n + col, pack4<kBf16>(v.x, v.y, v.z, v.w));
      }
    }
    return;
  }
  if (stores) {
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = 8 * nt + 2 * t + e;
        if (row >= a.m) continue;
        float* to = a.work + (static_cast<size_t>(blockIdx.y) * a.m + row) * a.n + col;
        asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(to),
                     "f"(acc[nt][0][e]), "f"(acc[nt][0][2 + e]), "f"(acc[nt][1][e]),
                     "f"(acc[nt][1][2 + e])
                     : "memory");
      }
    }
  }
  __threadfence();  // this CTA's sums are visible before its count is
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(a.counters + span, 1u) == static_cast<unsigned>(a.splits) - 1;
  __syncthreads();
  if (!*last) return;
  __threadfence();
  sum_splits<kBf16>(a, span);
  if (threadIdx.x == 0) a.counters[span] = 0;  // for the next launch
}

}  // namespace lmd_w4a16
