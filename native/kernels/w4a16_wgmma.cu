// W4A16 product for 33-64 rows on Hopper (sm_90a): y = x W^T (+ b), x [M <= 64, K] in
// bf16 or fp16, W 4-bit in groups of 128 inputs in the layout that w4a16_rows.cu reads
// (word row r of a block of 128 inputs holds nibble j of input 16 j + r; scales and zeros
// a group and column).
//
// wgmma.mma_async runs a warpgroup's m64 x n128 x k16 product asynchronously at the
// tensor cores' full rate with both operands in shared memory: A is x (its 64 rows,
// K-major), B 128 of the CTA's 256 columns of W already dequantized to x's dtype
// (K-major: a column's 64 inputs of a stage are one 128-byte row). Both in the 128-byte
// swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), so that the stores and the
// tensor cores' reads hit distinct banks.
//
// A CTA is five warpgroups with separate roles, which meet only at mbarriers:
// - the loader (warpgroup 4) copies by cp.async each block's words, scales and zeros into
//   a ring of kWordSlots blocks, kWordSlots - 1 blocks ahead, and each stage's x (64 rows
//   by 64 inputs) into its stage once the stage is free;
// - the fillers (warpgroups 2 and 3, one column a thread) take their column's words of a
//   block out of the ring and dequantize them into the block's two stages: (q - zero)
//   exact, times the scale, one rounding to x's dtype, 8 chunks of 16 bytes a stage;
// - warpgroups 0 and 1 (columns 0-127 and 128-255 of the span) wait for a stage to be
//   full, issue its four wgmmas, and free the stage before it once those are done
//   (wgmma.wait_group 1), so that the tensor cores have a stage queued while they wait
//   for the next.
// The fillers order their stores before wgmma's reads (the async proxy) with a fence
// that waits for all their memory operations, which is why no global load of theirs is
// in flight: the loader's copies are not theirs. The fillers' work is most of the CTA's
// instructions, so they are two warps a scheduler; the sums are split over two
// warpgroups (64 registers a thread each) so that 640 threads fit the registers.
//
// Grid: ceil(N / 256) column spans by `splits` ranges of K; with more than one split the
// float32 sums go to work [splits, M, N] and the last CTA of a span to finish adds them
// in split order, as w4a16_wide.cu does (a counter a span, reset by that CTA). Rows past
// M repeat row M - 1 in the stages, their outputs not stored; columns past N are zero.
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_wgmma.ptx, ISA 8.0, target
// sm_90a) is embedded and JIT-compiled by the driver at run time on a GPU of compute
// capability 9.0 only (native/decode_rows.cpp). After editing, run
// native/kernels/make_ptx.sh.
#include <stdint.h>

#include "sm90_ops.cuh"
#include "w4a16_ops.cuh"

struct W4a16Wgmma {  // the same fields as W4a16Wide (w4a16_wide.cu)
  const uint16_t* x;     // [m, k], row stride x_stride elements; 16-byte aligned rows
  const uint32_t* q;     // [k / 8, n]
  const uint16_t* s;     // [k / 128, n]
  const uint8_t* z;      // [k / 128, n]
  const uint16_t* bias;  // [n] or null
  uint16_t* y;           // [m, n]
  float* work;           // [splits, m, n] when splits > 1
  unsigned* counters;    // [ceil(n / 256)], zero between launches
  int m, n, k, x_stride, splits;
};

namespace lmd_w4a16 {

using namespace lmd_sm90;

constexpr int kSpan = 256;  // output columns a CTA: wgmma's n
constexpr int kRows = 64;   // wgmma's m
constexpr int kXBytes = kRows * 128;  // a stage's x: 64 inputs of 16 bits a row
constexpr int kWBytes = kSpan * 128;  // a stage's weights
constexpr int kStageBytes = kXBytes + kWBytes;
constexpr int kStages = 4;
constexpr int kWordBytes = 16 * kSpan * 4;  // a block's words: 16 rows of the span's
constexpr int kSlotBytes = kWordBytes + kSpan * 2 + kSpan;  // + scales + zeros
constexpr int kWordSlots = 3;
constexpr int kFillers = 256;  // threads 256-511; the loader's are 512-639
constexpr int kThreads = 640;  // warpgroups 0, 1 multiply, 2, 3 fill, 4 loads

struct Barriers {
  uint64_t full[kStages];   // a stage's x and W are in: the fillers and the loader, 384
  uint64_t empty[kStages];  // its wgmmas are done: warpgroups 0 and 1's 8 warps
  uint64_t words_full[kWordSlots];   // a block's words are in: the loader's 128
  uint64_t words_empty[kWordSlots];  // the fillers have taken them: 256
};

// A loader thread's share of every block and stage, fixed for the launch: 16 bytes a
// copy. Words: rows parity, parity + 2, .. of the block, 4 columns (n is a multiple of
// 32, so a copy is all in N or all past it; those past it are zeros). One copy of 8
// scales or 16 zeros for threads 0-47. x: chunk t % 8 of rows t / 8 + 16 i.
struct LoaderShare {
  const uint32_t* words;  // block 0's first row of the thread's copies
  uint32_t words_to;      // offset in a ring slot
  bool words_in;
  const uint8_t* extra;   // block 0's scales or zeros, or null
  uint32_t extra_to;
  bool extra_in;
  const uint16_t* x[4];   // the rows' first 8 inputs of the chunk
  uint32_t x_to[4];       // offsets in a stage
};

__device__ __forceinline__ LoaderShare loader_share(const W4a16Wgmma& a, int span, int t) {
  LoaderShare l;
  const int col = span * kSpan + 4 * (t & 63);
  l.words_in = col < a.n;
  l.words = a.q + static_cast<size_t>(t >> 6) * a.n + (l.words_in ? col : 0);
  l.words_to = (t >> 6) * kSpan * 4 + 16 * (t & 63);
  l.extra = nullptr;
  if (t < 48) {
    const bool zeros = t >= 32;
    const int at = span * kSpan + (zeros ? 16 * (t - 32) : 8 * t);
    l.extra_in = at < a.n;
    l.extra = zeros ? a.z + (l.extra_in ? at : 0)
                    : reinterpret_cast<const uint8_t*>(a.s + (l.extra_in ? at : 0));
    l.extra_to = kWordBytes + (zeros ? 2 * kSpan + 16 * (t - 32) : 16 * t);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = (t >> 3) + 16 * i;
    l.x[i] = a.x + static_cast<size_t>(min(row, a.m - 1)) * a.x_stride + 8 * (t & 7);
    l.x_to[i] = swizzled(row, t & 7);
  }
  return l;
}

// The loader: block kb's words, scales and zeros into a ring slot.
__device__ __forceinline__ void load_words(uint32_t slot, const LoaderShare& l,
                                           const W4a16Wgmma& a, int kb) {
  const size_t n = static_cast<size_t>(a.n);
  const uint32_t* from = l.words + 16 * kb * n;
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    cp_async16(slot + l.words_to + r * 2 * kSpan * 4, from + 2 * r * n, l.words_in);
  }
  if (l.extra != nullptr) {
    const size_t bytes = l.extra_to < kWordBytes + 2 * kSpan ? 2 : 1;  // scales : zeros
    cp_async16(slot + l.extra_to, l.extra + kb * n * bytes, l.extra_in);
  }
}

// The loader: inputs 64 h .. 64 h + 63 of block kb, all 64 rows, into a stage's x.
__device__ __forceinline__ void load_x(uint32_t x_stage, const LoaderShare& l, int kb, int h) {
#pragma unroll
  for (int i = 0; i < 4; ++i) cp_async16(x_stage + l.x_to[i], l.x[i] + 128 * kb + 64 * h);
}

// A column of a block, out of the ring: word rows 0..15, scale and zero.
struct Column {
  uint32_t w[16];
  uint32_t s;
  uint32_t z;
};

__device__ __forceinline__ void take_column(Column& c, const uint8_t* slot, int col) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(slot);
#pragma unroll
  for (int r = 0; r < 16; ++r) c.w[r] = words[r * kSpan + col];
  c.s = reinterpret_cast<const uint16_t*>(slot + kWordBytes)[col];
  c.z = slot[kWordBytes + 2 * kSpan + col];
}

// Half h of a block (inputs 64 h .. 64 h + 63, nibbles 4 h .. 4 h + 3) of the column, in
// x's dtype, into the stage's row `row` of W: chunk c holds inputs 8 c .. 8 c + 7 of the
// stage, nibble 4 h + c / 2 of word rows 8 (c % 2) .. 8 (c % 2) + 7. One prmt gathers a
// byte (two nibbles) of two word rows, so steps j and j + 1 share it.
template <bool kBf16>
__device__ __forceinline__ void dequantize_half(const Column& c, int h, uint32_t w_stage,
                                                int row, uint32_t mask, uint32_t magic) {
  constexpr uint32_t kNegMagic = kBf16 ? 0xC300u : 0xE400u;
  const uint32_t neg = (kNegMagic | c.z) * 0x10001u;  // -(magic + zero), both halves
  const uint32_t scale = c.s * 0x10001u;
  const uint32_t minus_zero = 0x80008000u;
#pragma unroll
  for (int b = 0; b < 2; ++b) {  // byte 2 h + b: steps 4 h + 2 b (low), + 1 (high)
    const int byte = 2 * h + b;
    const uint32_t sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12);
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // word rows 8 half .. 8 half + 7
      uint32_t lo[4];
      uint32_t hi[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const uint32_t pair = prmt(c.w[8 * half + 2 * p], c.w[8 * half + 2 * p + 1], sel);
        const uint32_t v_lo = minus<kBf16>(and_or(pair, mask, magic), neg);
        const uint32_t v_hi = minus<kBf16>(and_or(pair >> 4, mask, magic), neg);
        lo[p] = times<kBf16>(v_lo, scale, minus_zero);
        hi[p] = times<kBf16>(v_hi, scale, minus_zero);
      }
      // step 4 h + 2 b is chunk 2 (2 b) + half of the stage, step + 1 chunk 2 (2 b + 1)
      // + half
      store16(w_stage + swizzled(row, 4 * b + half), lo);
      store16(w_stage + swizzled(row, 4 * b + 2 + half), hi);
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return from_float<kBf16>(a) | (static_cast<uint32_t>(from_float<kBf16>(b)) << 16);
}

template <bool kBf16>
__device__ __forceinline__ float bias_at(const W4a16Wgmma& a, int col) {
  return a.bias == nullptr ? 0.0f : to_float<kBf16>(a.bias[col]);
}

// The last CTA of a span: y = the splits' sums in split order (+ bias), 4 columns a
// thread at a time, the splits' loads independent of each other.
template <bool kBf16>
__device__ __forceinline__ void sum_splits(const W4a16Wgmma& a, int span) {
  for (int e = threadIdx.x; e < a.m * (kSpan / 4); e += kThreads) {
    const int row = e / (kSpan / 4);
    const int col = span * kSpan + 4 * (e % (kSpan / 4));
    if (col >= a.n) continue;
    const float4* p = reinterpret_cast<const float4*>(a.work + static_cast<size_t>(row) * a.n + col);
    const size_t stride = static_cast<size_t>(a.m) * a.n / 4;
    float4 v = __ldcg(p);
#pragma unroll 4
    for (int sp = 1; sp < a.splits; ++sp) {
      const float4 t = __ldcg(p + sp * stride);
      v = make_float4(v.x + t.x, v.y + t.y, v.z + t.z, v.w + t.w);
    }
    const uint32_t lo = pack2<kBf16>(v.x + bias_at<kBf16>(a, col), v.y + bias_at<kBf16>(a, col + 1));
    const uint32_t hi =
        pack2<kBf16>(v.z + bias_at<kBf16>(a, col + 2), v.w + bias_at<kBf16>(a, col + 3));
    uint16_t* to = a.y + static_cast<size_t>(row) * a.n + col;
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(to), "r"(lo), "r"(hi) : "memory");
  }
}

// Warpgroup `group` (0, 1): every stage's wgmmas for its 128 columns, then its sums to y
// (one split) or work.
template <bool kBf16>
__device__ __forceinline__ void multiply(const W4a16Wgmma& a, Barriers& bars, uint32_t base,
                                         int stages, int span, int group) {
  float d[64];  // the first product overwrites it (accumulate 0)
  const uint32_t half = kXBytes + group * (kSpan / 2) * 128;  // its columns' rows of W
  for (int i = 0; i < stages; ++i) {
    const int s = i % kStages;
    const uint32_t stage = base + s * kStageBytes;
    wait(smem(&bars.full[s]), (i / kStages) & 1);
    hold(d);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // 16 inputs a wgmma: 32 bytes into the rows
      wgmma<kBf16>(d, descriptor(stage + 32 * kk), descriptor(stage + half + 32 * kk),
                   i > 0 || kk > 0);
    }
    wgmma_commit();
    wgmma_wait<1>();  // stage i - 1's products are done: free it
    hold(d);
    if (i > 0 && (threadIdx.x & 31) == 0) arrive(smem(&bars.empty[(i - 1) % kStages]));
  }
  wgmma_wait<0>();
  hold(d);
  // d[4 i + e] of warp w, lane l: row 16 w + l / 4 + 8 (e / 2), column 8 i + 2 (l % 4) +
  // e % 2 of the warpgroup's 128.
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kSpan / 16; ++i) {
    const int col = span * kSpan + group * (kSpan / 2) + 8 * i + 2 * (lane & 3);
    if (col >= a.n) continue;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 16 * warp + (lane >> 2) + 8 * e;
      if (row >= a.m) continue;
      const float v0 = d[4 * i + 2 * e];
      const float v1 = d[4 * i + 2 * e + 1];
      if (a.splits == 1) {
        const uint32_t v = pack2<kBf16>(v0 + bias_at<kBf16>(a, col), v1 + bias_at<kBf16>(a, col + 1));
        uint16_t* to = a.y + static_cast<size_t>(row) * a.n + col;
        asm volatile("st.global.b32 [%0], %1;" ::"l"(to), "r"(v) : "memory");
      } else {
        float* to = a.work + (static_cast<size_t>(blockIdx.y) * a.m + row) * a.n + col;
        asm volatile("st.global.cg.v2.f32 [%0], {%1, %2};" ::"l"(to), "f"(v0), "f"(v1) : "memory");
      }
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ void w4a16_wgmma(const W4a16Wgmma& a) {
  extern __shared__ __align__(1024) uint8_t dynamic[];
  __shared__ Barriers bars;
  __shared__ bool last;
  // Stages on 1,024-byte boundaries (the swizzle's period), then the ring of words; the
  // launch asks 1,024 bytes more than they take.
  const uint32_t base = (smem(dynamic) + 1023u) & ~1023u;
  const uint32_t ring = base + kStages * kStageBytes;
  const uint8_t* ring_ptr = dynamic + (ring - smem(dynamic));
  const int span = blockIdx.x;
  const int blocks = a.k / 128;
  const int first = static_cast<int>(static_cast<long long>(blockIdx.y) * blocks / a.splits);
  const int end = static_cast<int>(static_cast<long long>(blockIdx.y + 1) * blocks / a.splits);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(smem(&bars.full[s]), 384);
      barrier_init(smem(&bars.empty[s]), 8);
    }
    for (int s = 0; s < kWordSlots; ++s) {
      barrier_init(smem(&bars.words_full[s]), 128);
      barrier_init(smem(&bars.words_empty[s]), 256);
    }
  }
  __syncthreads();

  if (threadIdx.x >= 256 + kFillers) {
    const LoaderShare share = loader_share(a, span, threadIdx.x - 256 - kFillers);
    // Block first + t goes to slot t % kWordSlots, its stages 2 t, 2 t + 1.
    const auto words = [&](int t) {
      const int slot = t % kWordSlots;
      wait(smem(&bars.words_empty[slot]), ((t / kWordSlots) & 1) ^ 1);
      load_words(ring + slot * kSlotBytes, share, a, first + t);
      arrive_after_copies(smem(&bars.words_full[slot]));
    };
    for (int t = 0; t < kWordSlots - 1 && first + t < end; ++t) words(t);
    for (int t = 0; first + t < end; ++t) {
      if (first + t + kWordSlots - 1 < end) words(t + kWordSlots - 1);
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * t + h;
        const int s = i % kStages;
        wait(smem(&bars.empty[s]), ((i / kStages) & 1) ^ 1);
        load_x(base + s * kStageBytes, share, first + t, h);
        arrive_after_copies(smem(&bars.full[s]));
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else if (threadIdx.x >= 256) {
    const int col = threadIdx.x - 256;
    uint32_t mask = 0x000F000Fu;  // in registers, not immediates (w4a16_ops.cuh's and_or)
    uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
    asm("" : "+r"(mask), "+r"(magic));
    for (int t = 0; first + t < end; ++t) {
      const int slot = t % kWordSlots;
      Column c;
      wait(smem(&bars.words_full[slot]), (t / kWordSlots) & 1);
      take_column(c, ring_ptr + slot * kSlotBytes, col);
      arrive(smem(&bars.words_empty[slot]));
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * t + h;
        const int s = i % kStages;
        const uint32_t stage = base + s * kStageBytes;
        wait(smem(&bars.empty[s]), ((i / kStages) & 1) ^ 1);
        dequantize_half<kBf16>(c, h, stage + kXBytes, col, mask, magic);
        fence_async_proxy();
        arrive(smem(&bars.full[s]));
      }
    }
  } else {
    multiply<kBf16>(a, bars, base, 2 * (end - first), span, threadIdx.x >> 7);
  }
  if (a.splits == 1) return;
  __threadfence();  // this CTA's sums are visible before its count is
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(a.counters + span, 1u) == static_cast<unsigned>(a.splits) - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  sum_splits<kBf16>(a, span);
  if (threadIdx.x == 0) a.counters[span] = 0;  // for the next launch
}

}  // namespace lmd_w4a16

// One CTA a multiprocessor (its stages and ring take 211 KiB of shared memory): up to 96
// registers a thread.
#define LMD_W4A16_WGMMA(dtype, bf16)                                                     \
  extern "C" __global__ void __launch_bounds__(lmd_w4a16::kThreads, 1)                 \
      lmd_w4a16_wgmma_##dtype##_m64(const W4a16Wgmma a) {                               \
    lmd_w4a16::w4a16_wgmma<bf16>(a);                                                     \
  }

LMD_W4A16_WGMMA(bf16, true)
LMD_W4A16_WGMMA(f16, false)
