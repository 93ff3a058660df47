// The W4A16 product for 17-64 rows (a decode step of a larger batch): y = x W^T (+ b), x
// [M <= 64, K] in bf16 or fp16, W 4-bit in groups of 128 inputs in the layout that
// w4a16_rows.cu reads (daemon/engine/turbo/quant/w4a16.py). Everything but the tensor
// cores' feed, which w4a16_wide.cu (mma.sync, any GPU from sm_80) and w4a16_wgmma.cu
// (wgmma, Hopper) each define as a Feed type.
//
// A CTA is 4 warps side by side (one warpgroup), 128 output columns: at 64 rows each CTA
// of 32 columns reading all of x for itself would read 8 times the weights' bytes from
// L2. A lane's A operands are w4a16_ops.cuh's, from word rows 2t, 2t+1, 2t+8, 2t+9 of a
// block, so that A's column kappa is input 16 j + kappa (the inputs of a step in their
// own order, as both feeds read x); each weight is (q - zero) * scale rounded once to x's
// dtype in registers, so the float32 accumulators run across groups without a rescale:
// the product is the float32 sum of exact products of x and W rounded to x's dtype (the W
// that the dequantize-then-multiply route makes).
//
// Everything a block of 128 inputs needs goes through shared memory by cp.async, in
// three stages: x (all rows; rows past M repeat row M - 1, their outputs unstored) as
// 8 x 8 core matrices, 16 bytes a row, contiguous (the K-major layout wgmma reads without
// swizzle, and conflict-free for ldmatrix), the span's words, scales and zeros. Block kb
// + 2 is fetched into block kb - 1's stage once every warp is past that block's reads
// (the feed calls `mid` after step 1 of block kb); nothing of a block is waited on in
// registers (weights loaded into registers a block ahead stalled wgmma.fence and the
// scoreboards: measured).
//
// Grid: N / 128 column spans by `splits` ranges of K (enough CTAs for every
// multiprocessor to hold its share). With one split a CTA writes y. With more, each
// writes its float32 sums to work [splits, M, N], and the last CTA of a span to finish
// (a counter per span, reset by that CTA for the next launch) adds the splits in split
// order, adds the bias and writes y: deterministic, and nothing for the host to
// synchronize (decode steps capture it in their CUDA graphs). A span's counter is in use
// only during a launch; launches that share a counter array must be ordered (one stream).
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

constexpr int kWarps = 8;  // two warpgroups
constexpr int kSpan = 32 * kWarps;  // output columns a CTA
constexpr int kStages = 3;
constexpr int kPerStage = 2;  // blocks of K a stage: one wait and two barriers for both

// A block's bytes in a stage: x, the words (16 rows of the span's columns, each row 16
// bytes longer than the words, so that a quarter-warp's 16-byte reads of rows 2t ..
// fall in distinct banks), scales, zeros.
template <int kRows>
struct Stage {
  static constexpr int kQ = kRows * 256;
  static constexpr int kPitch = kSpan * 4 + 16;
  static constexpr int kS = kQ + 16 * kPitch;
  static constexpr int kZ = kS + kSpan * 2;
  static constexpr int kBytes = kZ + kSpan;
};

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t to, const void* from) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(from));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

// Every cp.async group but the newest kStages - 2 done (one group a stage).
__device__ __forceinline__ void wait_for_oldest() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");
}

__device__ __forceinline__ uint4 lds16(uint32_t at) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(at));
  return v;
}

__device__ __forceinline__ float4 load_cg(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}

// Block kb into a stage: x's rows as core matrices ((row / 8, inputs 8 p ..) at byte
// ((row / 8) * 16 + p) * 128, row % 8 at 16 bytes each), the words row-major (16 rows of
// 512 bytes), then scales and zeros. Columns past N are not fetched.
template <int kRows>
__device__ __forceinline__ void fetch(uint32_t stage, const W4a16Wide& a, int kb, int span) {
  constexpr int kThreads = 32 * kWarps;
#pragma unroll
  for (int i = 0; i < kRows * 16 / kThreads; ++i) {
    const int c = threadIdx.x + kThreads * i;
    const int row = c >> 4;
    const int piece = c & 15;
    const uint16_t* from =
        a.x + static_cast<size_t>(min(row, a.m - 1)) * a.x_stride + 128 * kb + 8 * piece;
    cp_async16(stage + ((row >> 3) * 16 + piece) * 128 + (row & 7) * 16, from);
  }
  const int col0 = span * kSpan;
  const size_t n = static_cast<size_t>(a.n);
#pragma unroll
  for (int i = 0; i < 16 * kSpan / 4 / kThreads; ++i) {
    const int c = threadIdx.x + kThreads * i;
    const int row = c / (kSpan / 4);
    const int col = col0 + 4 * (c % (kSpan / 4));
    if (col < a.n) {
      cp_async16(stage + Stage<kRows>::kQ + row * Stage<kRows>::kPitch + 4 * (col - col0),
                 a.q + (16 * static_cast<size_t>(kb) + row) * n + col);
    }
  }
  const size_t at = static_cast<size_t>(kb) * n + col0;
  if (threadIdx.x < kSpan / 8) {  // 8 scales a piece
    if (col0 + 8 * static_cast<int>(threadIdx.x) < a.n) {
      cp_async16(stage + Stage<kRows>::kS + 16 * threadIdx.x, a.s + at + 8 * threadIdx.x);
    }
  } else if (threadIdx.x < kSpan / 8 + kSpan / 16) {  // 16 zeros a piece
    const int p = threadIdx.x - kSpan / 8;
    if (col0 + 16 * p < a.n) cp_async16(stage + Stage<kRows>::kZ + 16 * p, a.z + at + 16 * p);
  }
}

// A lane's share of a block's weights: word rows 2t, 2t+1, 2t+8, 2t+9 at its 4 columns
// (16 bytes each), and their scales and zeros.
struct Weights {
  uint4 w[4];
  uint2 s;
  uint32_t z;
};

template <int kRows>
__device__ __forceinline__ void read_weights(Weights& b, uint32_t stage, int warp, int g, int t) {
  const int c = 32 * warp + 4 * g;
  constexpr int kPitch = Stage<kRows>::kPitch;
  const uint32_t q = stage + Stage<kRows>::kQ + 4 * c;
  b.w[0] = lds16(q + (2 * t) * kPitch);
  b.w[1] = lds16(q + (2 * t + 1) * kPitch);
  b.w[2] = lds16(q + (2 * t + 8) * kPitch);
  b.w[3] = lds16(q + (2 * t + 9) * kPitch);
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
               : "=r"(b.s.x), "=r"(b.s.y)
               : "r"(stage + Stage<kRows>::kS + 2 * c));
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(b.z) : "r"(stage + Stage<kRows>::kZ + c));
}

// The A tiles of step 2 byte + odd for this lane, W = (q - zero) * scale in x's dtype.
template <bool kBf16>
__device__ __forceinline__ void scaled_operands(const uint32_t (&pairs)[2][4], int odd,
                                                uint32_t mask, uint32_t magic,
                                                const uint32_t (&neg)[4],
                                                const uint32_t (&scale)[4], uint32_t (&a)[2][4]) {
  operands<kBf16>(pairs, odd, mask, magic, neg, a);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int r = 0; r < 4; ++r) a[h][r] = times<kBf16>(a[h][r], scale[2 * h + (r & 1)]);
  }
}

// -(magic + zero) and the scale of a lane's 4 columns, each in both halves of a register.
template <bool kBf16>
__device__ __forceinline__ void block_constants(const Weights& b, uint32_t (&neg)[4],
                                                uint32_t (&scale)[4]) {
  float unused[4];
  column_constants<kBf16>(b.s, b.z, neg, unused);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint32_t pair = c < 2 ? b.s.x : b.s.y;
    scale[c] = (c % 2 ? pair >> 16 : pair & 0xFFFFu) * 0x10001u;
  }
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
  if (threadIdx.x == 0) {
    *last = atomicAdd(a.counters + span, 1u) == static_cast<unsigned>(a.splits) - 1;
  }
  __syncthreads();
  if (!*last) return;
  __threadfence();
  sum_splits<kBf16>(a, span);
  if (threadIdx.x == 0) a.counters[span] = 0;  // for the next launch
}

// The kernel: Feed::block<kBf16, kTiles, kParity>(weights, stage, lane, mask, magic, acc,
// mid) multiplies one block (of parity kParity in the CTA's order, which alternates) and
// calls mid() once no read of the block before it is in flight, Feed::drain() waits for what it left in
// flight, Feed::kAsyncProxy says whether the tensor cores read shared memory
// through the async proxy (wgmma), which cp.async's writes must be fenced for.
template <bool kBf16, int kTiles, typename Feed>
__device__ __forceinline__ void w4a16_wide(const W4a16Wide& a) {
  constexpr int kRows = 8 * kTiles;
  extern __shared__ __align__(128) uint8_t smem[];  // kStages * Stage<kRows>::kBytes
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int span = blockIdx.x;
  const int col = span * kSpan + 32 * warp + 4 * g;
  const bool stores = col < a.n;  // a warp's 32 columns are all in or all out
  const int blocks = a.k / 128;
  const int first = static_cast<int>(static_cast<long long>(blockIdx.y) * blocks / a.splits);
  const int end = static_cast<int>(static_cast<long long>(blockIdx.y + 1) * blocks / a.splits);
  const uint32_t base = shared_address(smem);
  // Block i of this CTA's range, i = 0 .. count - 1: the spans start at different blocks
  // (rotated by the span), so that they do not all read the same block of x at once.
  const int count = end - first;
  const int rotation = span % count;
  const auto block_of = [&](int i) { return first + (i + rotation) % count; };
  // Stage i % kStages holds this CTA's blocks kPerStage i .. kPerStage i + kPerStage - 1.
  const int chunks = (count + kPerStage - 1) / kPerStage;
  const auto stage_of = [&](int i, int sub) {
    return base + ((i % kStages) * kPerStage + sub) * Stage<kRows>::kBytes;
  };
  const auto fetch_chunk = [&](int i) {
#pragma unroll
    for (int sub = 0; sub < kPerStage; ++sub) {
      if (kPerStage * i + sub < count) {
        fetch<kRows>(stage_of(i, sub), a, block_of(kPerStage * i + sub), span);
      }
    }
    commit();
  };
  uint32_t mask = 0x000F000Fu;  // in registers, not immediates (w4a16_ops.cuh's and_or)
  uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
  asm("" : "+r"(mask), "+r"(magic));

#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < chunks) {
      fetch_chunk(i);
    } else {
      commit();
    }
  }
  // Chunk next is fetched during chunk next - (kStages - 1), into chunk next - kStages's
  // stage, once the feed says that chunk's reads are done (mid, in the first block).
  int next = kStages - 1;
  const auto mid = [&]() {
    __syncthreads();
    if (next < chunks) {
      fetch_chunk(next);
    } else {
      commit();
    }
    ++next;
  };
  const auto nothing = []() {};
  float acc[kTiles][2][4] = {};
  Feed feed;
  for (int i = 0; i < chunks; ++i) {
    Weights b;
    wait_for_oldest();  // chunk i's group
    if constexpr (Feed::kAsyncProxy) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    read_weights<kRows>(b, stage_of(i, 0), warp, g, t);
    feed.template block<kBf16, kTiles, 0>(b, stage_of(i, 0), lane, mask, magic, acc, mid);
    if (kPerStage * i + 1 < count) {  // a parity a block of the chunk (kPerStage 2)
      read_weights<kRows>(b, stage_of(i, 1), warp, g, t);
      feed.template block<kBf16, kTiles, 1>(b, stage_of(i, 1), lane, mask, magic, acc, nothing);
    } else {
      feed.drain();  // the range's last block, alone in its chunk
    }
  }
  feed.drain();
  __syncthreads();  // every stage read: the first bytes hold the span's flag
  finish<kBf16, kTiles>(a, acc, span, col, stores, t, reinterpret_cast<bool*>(smem));
}

}  // namespace lmd_w4a16

// The shared memory a kernel of `rows` (32 or 64) rows takes, for its launch.
#define LMD_W4A16_WIDE_SMEM(rows) \
  (lmd_w4a16::kStages * lmd_w4a16::kPerStage * lmd_w4a16::Stage<rows>::kBytes)
