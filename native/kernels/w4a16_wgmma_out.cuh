// What native/kernels/w4a16_wgmma.cu's CTAs do with their sums besides storing them as
// y: the splits' sums of a span added through L2 (sum_span), and gate | up's sums made
// silu(gate) * up (store_gated).
#pragma once

#include <stdint.h>

#include "sm90_ops.cuh"
#include "w4a16_ops.cuh"
#include "w4a16_wgmma_load.cuh"

namespace lmd_w4a16 {

using namespace lmd_sm90;

// Split `split` of span `span`'s float32 sums in work: kRows x kSpan, row-major.
__device__ __forceinline__ float* sums_of(const W4a16Wide& a, int span, int split) {
  return a.work + (static_cast<size_t>(span) * a.splits + split) * kRows * kSpan;
}

template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return from_float<kBf16>(a) | (static_cast<uint32_t>(from_float<kBf16>(b)) << 16);
}

template <bool kBf16>
__device__ __forceinline__ float bias_at(const W4a16Wide& a, int col) {
  return a.bias == nullptr ? 0.0f : to_float<kBf16>(a.bias[col]);
}

// Every CTA of span `span` waits here until all a.splits have stored their sums (each
// thread its own before). The span's counter (64 bits, never reset) gains kSpanRound a
// launch, kSpanRound / splits a CTA, so it is a multiple of kSpanRound between launches
// and a CTA knows its launch's total from the count it added to.
__device__ __forceinline__ void span_wait(const W4a16Wide& a, int span) {
  __syncthreads();
  if (threadIdx.x == 0) {  // the CTA's stores, ordered before by the barrier, released
    unsigned long long* arrived = reinterpret_cast<unsigned long long*>(a.counters) + span;
    const unsigned long long share = kSpanRound / a.splits;
    unsigned long long seen;
    asm volatile("atom.release.gpu.global.add.u64 %0, [%1], %2;"
                 : "=l"(seen)
                 : "l"(arrived), "l"(share)
                 : "memory");
    const unsigned long long all = seen - seen % kSpanRound + kSpanRound;
    for (seen += share; seen < all;) {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(arrived) : "memory");
    }
  }
  __syncthreads();
}

// The splits' sums of span `span` (its CTAs, one a split), in work (sums_of): once every
// CTA of the span has stored its own, this one (split `split`) adds its share of the
// span's rows x 4-column groups over all the splits in split order (+ bias) into y.
// Every thread calls it after storing its sums. (Through L2, with a wait on counters
// rather than a cluster's barrier, so the splits need not fit the clusters a GPU
// co-schedules: docs/benchmarks.md.)
template <bool kBf16>
__device__ __forceinline__ void sum_span(const W4a16Wide& a, int span, int split) {
  span_wait(a, span);
  const int groups = a.m * (kSpan / 4);
  const int share = (groups + a.splits - 1) / a.splits;
  const int end = min(groups, (split + 1) * share);
  for (int e = split * share + threadIdx.x; e < end; e += kThreads) {
    const int row = e / (kSpan / 4);
    const int in_span = 4 * (e % (kSpan / 4));
    const int col = span * kSpan + in_span;
    if (col >= a.n) continue;
    float4 part[kMaxSplits];
#pragma unroll
    for (int sp = 0; sp < kMaxSplits; ++sp) {
      if (sp < a.splits) part[sp] = load_l2_16(sums_of(a, span, sp) + row * kSpan + in_span);
    }
    float4 v = part[0];
#pragma unroll
    for (int sp = 1; sp < kMaxSplits; ++sp) {
      if (sp < a.splits) {
        v = make_float4(v.x + part[sp].x, v.y + part[sp].y, v.z + part[sp].z, v.w + part[sp].w);
      }
    }
    const uint32_t lo =
        pack2<kBf16>(v.x + bias_at<kBf16>(a, col), v.y + bias_at<kBf16>(a, col + 1));
    const uint32_t hi =
        pack2<kBf16>(v.z + bias_at<kBf16>(a, col + 2), v.w + bias_at<kBf16>(a, col + 3));
    uint16_t* to = a.y + static_cast<size_t>(row) * a.n + col;
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(to), "r"(lo), "r"(hi) : "memory");
  }
}

// A multiplying thread's outputs to y (rows `stride` apart): for each of its rows
// 8 i + 2 t + e that has a row of y (rows.y_row), the two columns y_col, y_col + 1 that
// pair(i, e, that row) packs.
template <typename Rows, typename Pair>
__device__ __forceinline__ void store_pairs(const W4a16Wide& a, const Rows& rows, int stride,
                                            int y_col, Pair pair) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int i = 0; i < kRows / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = rows.y_row(8 * i + 2 * t + e);
      if (row < 0) continue;
      uint16_t* to = a.y + static_cast<size_t>(row) * stride + y_col;
      asm volatile("st.global.b32 [%0], %1;" ::"l"(to), "r"(pair(i, e, row)) : "memory");
    }
  }
}

// With a.gated (one split): warpgroups 2-3 hold up's sums for the columns whose gate's
// sums warpgroups 0-1 hold (thread i + 256 those of thread i); they hand them over through
// the x ring, free once every multiplying warpgroup's wgmmas are done, and threads 0-255
// store silu(gate) * up, each rounded to x's dtype first as a separate gate|up product
// and silu_and_mul would (y [m, n / 2]).
template <bool kBf16, typename Rows>
__device__ __forceinline__ void store_gated(const W4a16Wide& a, const Rows& rows,
                                            const float (&d)[32], uint32_t xs, int span,
                                            int col) {
  const uint32_t mine = xs + 4 * (threadIdx.x % 256);  // register r at mine + r * 1,024
  asm volatile("bar.sync 1, %0;" ::"n"(kMultipliers) : "memory");  // the ring is free
  if (threadIdx.x >= 256) {
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(mine + r * 1024), "f"(d[r]) : "memory");
    }
  }
  asm volatile("bar.sync 1, %0;" ::"n"(kMultipliers) : "memory");
  if (threadIdx.x >= 256) return;
  const int half = a.n / 2;
  const int y_col = span * (kSpan / 2) + col;
  if (y_col >= half) return;
  float up[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(up[r]) : "r"(mine + r * 1024) : "memory");
  }
  store_pairs(a, rows, half, y_col, [&](int i, int e, int) {
    float v[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      v[c] = silu_mul<kBf16>(d[4 * i + 2 * c + e], up[4 * i + 2 * c + e]);
    }
    return pack2<kBf16>(v[0], v[1]);
  });
}

}  // namespace lmd_w4a16
