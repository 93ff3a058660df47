// W4A16 product for 33-64 rows on Hopper (sm_90a): y = x W^T (+ b), x [M <= 64, K] in
// bf16 or fp16, W 4-bit in groups of 128 inputs in the layout that w4a16_rows.cu reads
// (word row r of a block of 128 inputs holds nibble j of input 16 j + r; scales and zeros
// a group and column).
//
// wgmma.mma_async runs a warpgroup's m64 x n64 x k16 product asynchronously at the
// tensor cores' rate with A in registers and B in shared memory. Here A is 64 output
// columns of W, made from the codes in the warpgroup's own registers (as the rows
// kernels make mma.sync's A, w4a16_ops.cuh: a warp's 16 rows, lane (g, t) holding
// columns 2 g, 2 g + 1 of them at inputs 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of a step, word
// rows of the same numbers), times the scale: one rounding to x's dtype, as the Triton
// tiles. B is x, 64 rows by 64 inputs a stage, K-major in the 128-byte swizzle (16-byte
// chunk c of row r at chunk c ^ (r % 8)); the sums come back transposed (row = column of
// y), 64 x 64 float32 in 32 registers a thread.
//
// A CTA is five warpgroups, meeting only at mbarriers:
// - warpgroup 4 loads by cp.async: two warps each block's words, scales and zeros for the
//   CTA's 256 columns into a ring of kWordSlots blocks as slots free up, two warps each
//   block's x (two stages, one barrier) into a ring of kXBlocks blocks once it is free;
// - warpgroups 0-3 (64 columns each) take their words of a block out of the ring, then
//   for each step of 16 inputs make A in one of two register sets and issue the wgmma,
//   waiting only for the step before (wgmma.wait_group 1) so that its registers are free
//   again: making a step's A overlaps the tensor cores' work on the last, and the four
//   warpgroups' steps overlap each other's. A block's x is freed once a step of the next
//   block has been waited for. (Four sets and wait_group 3 measured no faster.)
// (The rings, their barriers and the loader's copies: w4a16_wgmma_load.cuh; what the
// CTAs do with their sums: w4a16_wgmma_out.cuh.)
// The global loads are all the loader's, so no multiplying warp waits on memory but at a
// barrier.
//
// Grid: ceil(N / 256) column spans by `splits` (at most 8) ranges of K; with more than
// one split every CTA is resident at once (a cooperative launch, native/decode_rows.cpp):
// each stores its float32 sums to work ([spans x splits, 64, 256]), and once all of its
// span's CTAs have (counted in counters) each adds a share of the span's outputs over
// all of them in split order. Rows past M repeat row M - 1 in the stages, their outputs
// not stored; columns past N are zero.
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_wgmma.ptx, ISA 8.0, target
// sm_90a) is embedded and JIT-compiled by the driver at run time on a GPU of compute
// capability 9.0 only (native/decode_rows.cpp). After editing, run
// native/kernels/make_ptx.sh.
#include <stdint.h>

#include "sm90_ops.cuh"
#include "w4a16_ops.cuh"
#include "w4a16_wgmma_load.cuh"
#include "w4a16_wgmma_out.cuh"

namespace lmd_w4a16 {

using namespace lmd_sm90;

// A lane's share of a block: word rows 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of its two
// columns, their -(magic + zero) and scale in both halves of a register.
struct Share {
  uint2 w[4];
  uint32_t neg[2];
  uint32_t scale[2];
};

// A lane's addresses in the ring's slot 0 (shared memory): its word rows 2 t, its scales,
// its zeros; slot k's are kSlotBytes k further.
struct ShareAt {
  uint32_t words, scales, zeros;
};

template <bool kBf16>
__device__ __forceinline__ void take_share(Share& sh, const ShareAt& at, uint32_t slot_offset) {
  constexpr uint32_t kNegMagic = kBf16 ? 0xC300u : 0xE400u;
  const uint32_t rows[4] = {0, kSpan * 4, 8 * kSpan * 4, 9 * kSpan * 4};  // 2 t + 0, 1, 8, 9
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                 : "=r"(sh.w[r].x), "=r"(sh.w[r].y)
                 : "r"(at.words + slot_offset + rows[r]));
  }
  uint32_t s, z;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(s) : "r"(at.scales + slot_offset));
  asm volatile("ld.shared.u16 %0, [%1];" : "=r"(z) : "r"(at.zeros + slot_offset));
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    sh.neg[c] = (kNegMagic | ((z >> (8 * c)) & 0xFFu)) * 0x10001u;
    sh.scale[c] = ((s >> (16 * c)) & 0xFFFFu) * 0x10001u;
  }
}

// A of step j of the block: register r is (column r % 2, inputs of pair r / 2): nibble j
// of word rows 2 (r / 2), 2 (r / 2) + 1 of the share (one prmt, a shift for odd j, a lop3
// for the magic), q - zero exact, then times the scale.
template <bool kBf16>
__device__ __forceinline__ void make_a(const Share& sh, int j, uint32_t mask, uint32_t magic,
                                       uint32_t (&a)[4]) {
  const int byte = j >> 1;
  const uint32_t sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int c = r & 1;
    const int p = r >> 1;
    const uint32_t lo = c ? sh.w[2 * p].y : sh.w[2 * p].x;
    const uint32_t hi = c ? sh.w[2 * p + 1].y : sh.w[2 * p + 1].x;
    uint32_t pair = prmt(lo, hi, sel);
    if (j & 1) pair >>= 4;
    a[r] = times<kBf16>(minus<kBf16>(and_or(pair, mask, magic), sh.neg[c]), sh.scale[c],
                        0x80008000u);
  }
}

__device__ __forceinline__ void hold_a(uint32_t (&a)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[r])::"memory");
}

// Warpgroup `group` (0-3): its 64 columns over the CTA's blocks, then its sums to y (one
// split) or to work (sums_of) for sum_span.
template <bool kBf16, typename Rows>
__device__ __forceinline__ void multiply(const W4a16Wide& a, const Rows& rows, Barriers& bars,
                                         uint32_t xs, uint32_t ring, int first, int end,
                                         int span) {
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int t = lane & 3;
  const int col = (threadIdx.x >> 7) * 64 + 16 * warp + 2 * (lane >> 2);  // in the span
  uint32_t mask = 0x000F000Fu;  // in registers, not immediates (w4a16_ops.cuh's and_or)
  uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
  asm("" : "+r"(mask), "+r"(magic));
  const ShareAt at{ring + 2 * t * kSpan * 4 + 4 * col, ring + kWordBytes + 2 * col,
                   ring + kWordBytes + 2 * kSpan + col};
  float d[32];  // the first product overwrites it (accumulate 0)
  uint32_t sets[2][4];  // step jj of a stage's A in set jj % 2
  // x's descriptor; a step's adds (stage offset + 32 jj) / 16 to its low half, which
  // the start address (bits 0-13) never carries out of.
  const uint64_t x_desc = descriptor(xs);
  const uint32_t x_lo = static_cast<uint32_t>(x_desc);
  const uint32_t x_hi = static_cast<uint32_t>(x_desc >> 32);
  // Four blocks a pass: each step's stage, so its descriptor's offset, is a constant.
  static_assert(kXBlocks == 4, "a pass is the x ring's four blocks");
  for (unsigned b0 = 0; first + static_cast<int>(b0) < end; b0 += 4) {
    const unsigned phase = (b0 / 4) & 1;  // of the x blocks' barriers this pass
#pragma unroll
    for (unsigned u = 0; u < 4; ++u) {
      const unsigned b = b0 + u;
      if (first + static_cast<int>(b) >= end) break;
      const unsigned slot = b % kWordSlots;
      Share sh;
      wait(smem(&bars.words_full[slot]), (b / kWordSlots) & 1);
      take_share<kBf16>(sh, at, slot * kSlotBytes);
      arrive(smem(&bars.words_empty[slot]));
      wait(smem(&bars.full[u]), phase);
#pragma unroll
      for (unsigned h = 0; h < 2; ++h) {
        const unsigned s = 2 * u + h;
#pragma unroll
        for (unsigned jj = 0; jj < 4; ++jj) {
          make_a<kBf16>(sh, 4 * h + jj, mask, magic, sets[jj % 2]);
          hold(d);
          wgmma_fence();
          wgmma<kBf16>(d, sets[jj % 2], x_lo + s * (kXBytes >> 4) + 2 * jj, x_hi,
                       b > 0 || h > 0 || jj > 0);
          wgmma_commit();
          wgmma_wait<1>();  // the step before is done: its registers and stage are free
          hold(d);
          hold_a(sets[(jj + 1) % 2]);
          if (jj == 0 && h == 0 && b > 0 && lane == 0) {
            arrive(smem(&bars.empty[(u + kXBlocks - 1) % kXBlocks]));
          }
        }
      }
    }
  }
  wgmma_wait<0>();
  hold(d);
  // d[4 i + e]: column col + e / 2 (row 16 warp + lane / 4 + 8 (e / 2) of A), x row 8 i +
  // 2 t + e % 2.
  if (a.splits > 1) {
    float* sums = sums_of(a, span, blockIdx.y);
#pragma unroll
    for (int i = 0; i < kRows / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float* to = sums + (8 * i + 2 * t + e) * kSpan + col;
        asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(to), "f"(d[4 * i + e]),
                     "f"(d[4 * i + 2 + e])
                     : "memory");
      }
    }
    return;
  }
  if (a.gated) {
    store_gated<kBf16>(a, rows, d, xs, span, col);
    return;
  }
  const int y_col = span * kSpan + col;
  if (y_col >= a.n) return;
  const float bias0 = bias_at<kBf16>(a, y_col);
  const float bias1 = bias_at<kBf16>(a, y_col + 1);
  store_pairs(a, rows, a.n, y_col, [&](int i, int e, int row) {
    return pack2<kBf16>(rows.times(row, d[4 * i + e] + bias0),
                        rows.times(row, d[4 * i + 2 + e] + bias1));
  });
}

// The CTA of span blockIdx.x and split `split` of K over a's rows (`rows`: DenseRows or
// PairRows).
template <bool kBf16, typename Rows>
__device__ __forceinline__ void w4a16_wgmma(const W4a16Wide& a, const Rows& rows, int split) {
  extern __shared__ __align__(1024) uint8_t dynamic[];
  __shared__ Barriers bars;
  // Stages on 1,024-byte boundaries (the swizzle's period), then the ring of words; the
  // launch asks 1,024 bytes more than they take.
  const uint32_t xs = (smem(dynamic) + 1023u) & ~1023u;
  const uint32_t ring = xs + kStages * kXBytes;
  const int span = blockIdx.x;
  const int blocks = a.k / 128;
  const int first = static_cast<int>(static_cast<long long>(split) * blocks / a.splits);
  const int end = static_cast<int>(static_cast<long long>(split + 1) * blocks / a.splits);
  // The loader asks for its first block of x and of words before the barriers are set up,
  // so that their latency runs under that and the barrier; arrive_after_copies, after it,
  // counts them in as it does the later blocks'. (Each CTA has a block: splits <= blocks.)
  const bool x_loader = threadIdx.x >= kMultipliers + 64;
  const bool words_loader = !x_loader && threadIdx.x >= kMultipliers;
  XShare x_at;
  WordsShare words_at;
  if (x_loader) {
    x_at = x_share(a, rows, threadIdx.x - kMultipliers - 64);
    load_x(xs, x_at, first);
  } else if (words_loader) {
    words_at = words_share(a, span, threadIdx.x - kMultipliers);
    load_words(ring, words_at, a, first);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kXBlocks; ++s) {
      barrier_init(smem(&bars.full[s]), 64);
      barrier_init(smem(&bars.empty[s]), 16);
    }
    for (int s = 0; s < kWordSlots; ++s) {
      barrier_init(smem(&bars.words_full[s]), 64);
      barrier_init(smem(&bars.words_empty[s]), kMultipliers);
    }
  }
  __syncthreads();

  if (x_loader) {  // x, a block's two stages once they are free
    arrive_after_copies(smem(&bars.full[0]));
    for (int i = 1; first + i < end; ++i) {
      const int u = i % kXBlocks;
      wait(smem(&bars.empty[u]), ((i / kXBlocks) & 1) ^ 1);
      load_x(xs + 2 * u * kXBytes, x_at, first + i);
      arrive_after_copies(smem(&bars.full[u]));
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else if (words_loader) {  // words, a block once its slot is free
    arrive_after_copies(smem(&bars.words_full[0]));
    for (int b = 1; first + b < end; ++b) {
      const int slot = b % kWordSlots;
      wait(smem(&bars.words_empty[slot]), ((b / kWordSlots) & 1) ^ 1);
      load_words(ring + slot * kSlotBytes, words_at, a, first + b);
      arrive_after_copies(smem(&bars.words_full[slot]));
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {
    multiply<kBf16>(a, rows, bars, xs, ring, first, end, span);
  }
  if (a.splits > 1) sum_span<kBf16>(a, span, split);
}

// A block of 64 pairs sorted by expert (blockIdx.y) as a product of one split: the
// block's expert's words, its pairs' rows of x, their sums to their rows of y (times
// their routing weights when given). A block of expert -1 returns at once.
template <bool kBf16>
__device__ __forceinline__ void w4a16_wgmma_experts(const W4a16Experts& e) {
  const int expert = e.experts[blockIdx.y];
  if (expert < 0) return;
  const size_t groups = static_cast<size_t>(expert) * (e.k / 128) * e.n;  // [K / 128, N] each
  const W4a16Wide a{e.x,    e.q + 16 * groups, e.s + groups, e.z + groups, nullptr, e.y,
                    nullptr, nullptr, kRows,   e.n,          e.k,          e.x_stride, 1,
                    e.gated};
  const PairRows rows{e.pairs + static_cast<size_t>(blockIdx.y) * kRows, e.weights,
                      e.num_pairs, e.row_div};
  w4a16_wgmma<kBf16>(a, rows, 0);
}

}  // namespace lmd_w4a16

// One CTA a multiprocessor (its rings take 198 KiB of shared memory): up to 96 registers
// a thread.
#define LMD_W4A16_WGMMA(dtype, bf16)                                                     \
  extern "C" __global__ void __launch_bounds__(lmd_w4a16::kThreads, 1)                 \
      lmd_w4a16_wgmma_##dtype##_m64(const W4a16Wide a) {                               \
    lmd_w4a16::w4a16_wgmma<bf16>(a, lmd_w4a16::DenseRows{a.m}, blockIdx.y);              \
  }                                                                                      \
  extern "C" __global__ void __launch_bounds__(lmd_w4a16::kThreads, 1)                 \
      lmd_w4a16_wgmma_experts_##dtype##_m64(const W4a16Experts a) {                    \
    lmd_w4a16::w4a16_wgmma_experts<bf16>(a);                                             \
  }

LMD_W4A16_WGMMA(bf16, true)
LMD_W4A16_WGMMA(f16, false)
