// The layout and the loader of native/kernels/w4a16_wgmma.cu (its comment says how the
// kernel works): the CTA's shared-memory rings, their barriers, and the loader warps'
// copies of x's stages and the words' blocks into them.
#pragma once

#include <stdint.h>

#include "../decode_rows.h"  // the host's launch constants, checked against these below
#include "sm90_ops.cuh"
#include "w4a16_ops.cuh"

namespace lmd_w4a16 {

using namespace lmd_sm90;

constexpr int kSpan = 256;  // output columns a CTA
constexpr int kRows = 64;   // x's rows a stage: wgmma's n
constexpr int kXBytes = kRows * 128;  // a stage: 64 inputs of 16 bits a row
constexpr int kStages = 8;  // halves of a block of x; a block's two share its barriers
constexpr int kXBlocks = kStages / 2;
constexpr int kWordBytes = 16 * kSpan * 4;  // a block's words: 16 rows of the span's
constexpr int kSlotBytes = kWordBytes + kSpan * 2 + kSpan;  // + scales + zeros
constexpr int kWordSlots = 8;
constexpr int kMultipliers = 512;  // warpgroups 0-3; the loader's threads are 512-639
constexpr int kThreads = 640;
constexpr int kMaxSplits = 8;  // a span's CTAs (sum_span holds a share of each)
constexpr unsigned long long kSpanRound = 840;  // what a launch adds to a span's counter
constexpr bool divides_by_each(unsigned long long v, int up_to) {
  return up_to == 0 || (v % up_to == 0 && divides_by_each(v, up_to - 1));
}
static_assert(divides_by_each(kSpanRound, kMaxSplits), "every count of splits divides kSpanRound");
// What native/decode_rows.cpp launches with: the rings and 1,024 bytes to align them.
static_assert(kThreads == lmd::kW4a16WgmmaThreads && kSpan == lmd::kW4a16WgmmaColumns &&
                  kRows == lmd::kW4a16WgmmaMaxRows && kMaxSplits == lmd::kW4a16WgmmaMaxSplits,
              "decode_rows.h's wgmma constants");
static_assert(kStages * kXBytes + kWordSlots * kSlotBytes + 1024 == lmd::kW4a16WgmmaSharedBytes,
              "decode_rows.h's kW4a16WgmmaSharedBytes");

struct Barriers {
  uint64_t full[kXBlocks];   // a block's x is in: the loader's 64 x threads
  uint64_t empty[kXBlocks];  // its wgmmas are done: the multiplying warpgroups' 16 warps
  uint64_t words_full[kWordSlots];   // a block's words are in: its 64 words threads
  uint64_t words_empty[kWordSlots];  // the multiplying threads have taken them: 512
};

// The loader's threads 0-63 copy words, 64-127 x, so that a stage's x arrival (an
// L2 hit) tracks x's copies only: cp.async.mbarrier.arrive waits for every copy the
// thread issued before it, and the words run blocks ahead from DRAM.
// A words thread's share of every block, fixed for the launch: 16 bytes a copy, the
// block's 16 rows at 4 columns (n is a multiple of 32, gated of 64, so a copy is all
// in W or all past it; those past it are zeros), and one copy of 8 scales or 16 zeros for
// threads 0-47.
struct WordsShare {
  const uint32_t* words;  // block 0's first row at the thread's columns
  uint32_t to;            // offset in a ring slot
  bool in;
  const uint8_t* extra;   // block 0's scales or zeros, or null
  uint32_t extra_to;
  bool extra_in;
};

// W's column for column c (0..255) of span `span`, and whether it is in W: with a.gated,
// the span's first half is gate's columns (W's first n / 2) and its second half up's, the
// same outputs of both.
__device__ __forceinline__ int2 weight_column(const W4a16Wide& a, int span, int c) {
  if (!a.gated) return make_int2(span * kSpan + c, span * kSpan + c < a.n);
  const int half = a.n / 2;
  const int out = span * (kSpan / 2) + c % (kSpan / 2);
  return make_int2((c >= kSpan / 2 ? half : 0) + out, out < half);
}

__device__ __forceinline__ WordsShare words_share(const W4a16Wide& a, int span, int t) {
  WordsShare l;
  const int2 col = weight_column(a, span, 4 * t);
  l.in = col.y;
  l.words = a.q + (l.in ? col.x : 0);
  l.to = 16 * t;
  l.extra = nullptr;
  if (t < 48) {
    const bool zeros = t >= 32;
    const int2 at = weight_column(a, span, zeros ? 16 * (t - 32) : 8 * t);
    l.extra_in = at.y;
    l.extra = zeros ? a.z + (l.extra_in ? at.x : 0)
                    : reinterpret_cast<const uint8_t*>(a.s + (l.extra_in ? at.x : 0));
    l.extra_to = kWordBytes + (zeros ? 2 * kSpan + 16 * (t - 32) : 16 * t);
  }
  return l;
}

// Block kb's words, scales and zeros into a ring slot.
__device__ __forceinline__ void load_words(uint32_t slot, const WordsShare& l,
                                           const W4a16Wide& a, int kb) {
  const size_t n = static_cast<size_t>(a.n);
  const uint32_t* from = l.words + 16 * kb * n;
#pragma unroll
  for (int r = 0; r < 16; ++r) cp_async16(slot + l.to + r * kSpan * 4, from + r * n, l.in);
  if (l.extra != nullptr) {
    const size_t bytes = l.extra_to < kWordBytes + 2 * kSpan ? 2 : 1;  // scales : zeros
    cp_async16(slot + l.extra_to, l.extra + kb * n * bytes, l.extra_in);
  }
}

// Which row of x a CTA's row r (0..63) reads, and which row of y its sums go to (-1:
// none) times what. A dense product's rows are x's and y's (past m: row m - 1, not
// stored); an experts block's are its 64 sorted pairs' (kernels/moe_align.py's layout:
// padding, a pair id of num_pairs, reads the block's first pair's row, always a real one).
struct DenseRows {
  int m;
  __device__ __forceinline__ int x_row(int r) const { return min(r, m - 1); }
  __device__ __forceinline__ int y_row(int r) const { return r < m ? r : -1; }
  __device__ __forceinline__ float times(int, float v) const { return v; }
};

struct PairRows {
  const int32_t* pairs;   // the block's
  const float* weights;  // routing weights by pair, or null
  int num_pairs, row_div;
  __device__ __forceinline__ int x_row(int r) const {
    const int pair = pairs[r];
    return (pair < num_pairs ? pair : pairs[0]) / row_div;
  }
  __device__ __forceinline__ int y_row(int r) const {
    const int pair = pairs[r];
    return pair < num_pairs ? pair : -1;
  }
  __device__ __forceinline__ float times(int pair, float v) const {
    return weights == nullptr ? v : v * weights[pair];
  }
};

// An x thread's share of every stage: chunk t % 8 of rows t / 8 + 8 i.
struct XShare {
  const uint16_t* x[8];  // the rows' first 8 inputs of the chunk
  uint32_t to[8];        // offsets in a stage
};

template <typename Rows>
__device__ __forceinline__ XShare x_share(const W4a16Wide& a, const Rows& rows, int t) {
  XShare l;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = (t >> 3) + 8 * i;
    l.x[i] = a.x + static_cast<size_t>(rows.x_row(row)) * a.x_stride + 8 * (t & 7);
    l.to[i] = swizzled(row, t & 7);
  }
  return l;
}

// Block kb's x, all 64 rows, into a block of the ring: inputs 64 h .. 64 h + 63 into
// its stage h.
__device__ __forceinline__ void load_x(uint32_t x_block, const XShare& l, int kb) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      cp_async16(x_block + h * kXBytes + l.to[i], l.x[i] + 128 * kb + 64 * h);
    }
  }
}

}  // namespace lmd_w4a16
