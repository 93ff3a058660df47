// W4A16 product for 17-64 rows on Hopper (sm_90a): w4a16_wide.cu's kernel with wgmma in
// place of mma.sync. w4a16_wide.cu reaches a quarter of the tensor cores' rate at 64 rows
// on an H200 (mma.sync at 2 warps a sub-partition); wgmma.mma_async runs a warpgroup's
// m64 x n x k16 product asynchronously at the full rate, taking A from registers and B
// from shared memory.
//
// The CTA is one warpgroup (4 warps, 128 columns, as w4a16_wide.cu): warp w's A tiles
// h = 0, 1 (its 32 columns, w4a16_ops.cuh) are rows 16 w .. 16 w + 15 of the warpgroup's
// two m64 A operands, whose register layout a warp holds as mma.m16n8k16's A, and the
// accumulators come back in mma's D layout, so w4a16_wide.cuh's finish stores them.
// Here a weight is (q - zero) * scale rounded once to x's dtype in registers (one more
// packed fma), so the accumulators run across groups without a rescale, and the product
// is the float32 sum of exact products of x and W rounded to x's dtype (the same W that
// the dequantize-then-multiply route makes).
//
// x goes through shared memory in wgmma's K-major core matrices without swizzle (8 rows
// of 16 bytes contiguous), three stages by cp.async: block kb + 2 is fetched into the
// stage of block kb - 1 once its wgmmas are done (after step 1 of block kb, at most one
// group in flight), each block's weights a block ahead in a second set of registers.
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_wgmma.ptx, ISA 8.0, sm_90a) is
// embedded and JIT-compiled by the driver at run time (native/w4a16_rows.cpp), on a GPU
// of compute capability 9.0 only. After editing, run native/kernels/make_ptx.sh.
#include "w4a16_wide.cuh"

namespace lmd_w4a16 {

constexpr int kStages = 3;

// Block kb of x into a stage as core matrices: (row / 8, inputs 8 p .. 8 p + 7) at byte
// ((row / 8) * 16 + p) * 128, row % 8 at 16 bytes each.
template <int kRows>
__device__ __forceinline__ void stage_cores(uint32_t stage, const W4a16Wide& a, int kb) {
#pragma unroll
  for (int i = 0; i < kRows * 16 / (32 * kWarps); ++i) {
    const int c = threadIdx.x + 32 * kWarps * i;
    const int row = c >> 4;
    const int piece = c & 15;
    const uint16_t* from =
        a.x + static_cast<size_t>(min(row, a.m - 1)) * a.x_stride + 128 * kb + 8 * piece;
    cp_async16(stage + ((row >> 3) * 16 + piece) * 128 + (row & 7) * 16, from);
  }
}

// Step j's B (inputs 16 j .. 16 j + 15 of every row): the address / 16 in bits 0-13, the
// leading byte offset (the next 8 inputs, 128 bytes) / 16 in bits 16-29, the stride byte
// offset (the next 8 rows, 2048 bytes) / 16 in bits 32-45, no swizzle (bits 62-63 0).
__device__ __forceinline__ uint64_t b_descriptor(uint32_t stage, int j) {
  const uint32_t at = stage + 256 * j;
  return static_cast<uint64_t>((at & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(2048 >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// cp.async's writes (the generic proxy) made visible to wgmma's reads (the async proxy).
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// acc[.][h] += A (this warp's rows of m64 tile h) x B (the descriptor's rows of x).
#define LMD_WGMMA_N32(T)                                                                 \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                      \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "  \
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"                                                 \
      : "+f"(acc[0][h][0]), "+f"(acc[0][h][1]), "+f"(acc[0][h][2]), "+f"(acc[0][h][3]),     \
        "+f"(acc[1][h][0]), "+f"(acc[1][h][1]), "+f"(acc[1][h][2]), "+f"(acc[1][h][3]),     \
        "+f"(acc[2][h][0]), "+f"(acc[2][h][1]), "+f"(acc[2][h][2]), "+f"(acc[2][h][3]),     \
        "+f"(acc[3][h][0]), "+f"(acc[3][h][1]), "+f"(acc[3][h][2]), "+f"(acc[3][h][3])     \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))

#define LMD_WGMMA_N64(T)                                                                 \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                      \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"                                                 \
      : "+f"(acc[0][h][0]), "+f"(acc[0][h][1]), "+f"(acc[0][h][2]), "+f"(acc[0][h][3]),     \
        "+f"(acc[1][h][0]), "+f"(acc[1][h][1]), "+f"(acc[1][h][2]), "+f"(acc[1][h][3]),     \
        "+f"(acc[2][h][0]), "+f"(acc[2][h][1]), "+f"(acc[2][h][2]), "+f"(acc[2][h][3]),     \
        "+f"(acc[3][h][0]), "+f"(acc[3][h][1]), "+f"(acc[3][h][2]), "+f"(acc[3][h][3]),     \
        "+f"(acc[4][h][0]), "+f"(acc[4][h][1]), "+f"(acc[4][h][2]), "+f"(acc[4][h][3]),     \
        "+f"(acc[5][h][0]), "+f"(acc[5][h][1]), "+f"(acc[5][h][2]), "+f"(acc[5][h][3]),     \
        "+f"(acc[6][h][0]), "+f"(acc[6][h][1]), "+f"(acc[6][h][2]), "+f"(acc[6][h][3]),     \
        "+f"(acc[7][h][0]), "+f"(acc[7][h][1]), "+f"(acc[7][h][2]), "+f"(acc[7][h][3])     \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))

template <bool kBf16, int kTiles>
__device__ __forceinline__ void wgmma(float (&acc)[kTiles][2][4], int h, const uint32_t (&a)[4],
                                      uint64_t desc) {
  if constexpr (kTiles == 4) {
    if constexpr (kBf16) {
      LMD_WGMMA_N32("bf16");
    } else {
      LMD_WGMMA_N32("f16");
    }
  } else {
    if constexpr (kBf16) {
      LMD_WGMMA_N64("bf16");
    } else {
      LMD_WGMMA_N64("f16");
    }
  }
}

// v * s in both halves, rounded once (v * s + -0).
template <bool kBf16>
__device__ __forceinline__ uint32_t times(uint32_t v, uint32_t s) {
  uint32_t d;
  if (kBf16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(s), "r"(0x80008000u));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(s), "r"(0x80008000u));
  }
  return d;
}

// A block's 8 steps, at most two in flight; `mid` runs after step 1 (every step of the
// blocks before done).
template <bool kBf16, int kTiles, typename Mid>
__device__ __forceinline__ void multiply_block(const Weights& b, uint32_t stage, uint32_t mask,
                                               uint32_t magic, float (&acc)[kTiles][2][4],
                                               const Mid& mid) {
  uint32_t neg[4];
  float unused[4];
  column_constants<kBf16>(b.s, b.z, neg, unused);
  uint32_t scale[4];  // both halves
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint32_t pair = c < 2 ? b.s.x : b.s.y;
    scale[c] = (c % 2 ? pair >> 16 : pair & 0xFFFFu) * 0x10001u;
  }
#pragma unroll
  for (int byte = 0; byte < 4; ++byte) {
    uint32_t pairs[2][4];
    gather_pairs(b.w, byte, pairs);
#pragma unroll
    for (int odd = 0; odd < 2; ++odd) {
      const int j = 2 * byte + odd;
      uint32_t a[2][4];
      operands<kBf16>(pairs, odd, mask, magic, neg, a);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[h][r] = times<kBf16>(a[h][r], scale[2 * h + (r & 1)]);
      }
      wgmma_fence();
      wgmma<kBf16, kTiles>(acc, 0, a[0], b_descriptor(stage, j));
      wgmma<kBf16, kTiles>(acc, 1, a[1], b_descriptor(stage, j));
      wgmma_commit();
      wgmma_wait<1>();
      if (j == 1) mid();
    }
  }
}

template <bool kBf16, int kTiles>
__device__ __forceinline__ void w4a16_wgmma(const W4a16Wide& a) {
  constexpr int kRows = 8 * kTiles;
  constexpr int kStageBytes = kRows * 256;
  __shared__ __align__(128) uint8_t xs[kStages * kStageBytes];  // 48 KB at 64 rows
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int span = blockIdx.x;
  const int col = span * kSpan + 32 * warp + 4 * g;
  const bool stores = col < a.n;              // a warp's 32 columns are all in or all out
  const int load_col = stores ? col : 4 * g;  // a span's last warps past N load span 0's
  const int blocks = a.k / 128;
  const int first = static_cast<int>(static_cast<long long>(blockIdx.y) * blocks / a.splits);
  const int end = static_cast<int>(static_cast<long long>(blockIdx.y + 1) * blocks / a.splits);
  const uint32_t base = shared_address(xs);
  const auto stage_of = [&](int kb) { return base + ((kb - first) % kStages) * kStageBytes; };
  uint32_t mask = 0x000F000Fu;  // in registers, not immediates (w4a16_ops.cuh's and_or)
  uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
  asm("" : "+r"(mask), "+r"(magic));

  float acc[kTiles][2][4] = {};
  Weights even;
  Weights odd;
  stage_cores<kRows>(stage_of(first), a, first);
  commit();
  if (first + 1 < end) stage_cores<kRows>(stage_of(first + 1), a, first + 1);
  commit();
  load_weights(even, a, first, load_col, t);
  // During block kb: block kb + 2's x into block kb - 1's stage, one cp.async group a block.
  int fetch = first + 2;
  const auto prefetch = [&]() {
    __syncthreads();
    if (fetch < end) stage_cores<kRows>(stage_of(fetch), a, fetch);
    commit();
    ++fetch;
  };
  for (int kb = first; kb < end; kb += 2) {
    if (kb + 1 < end) load_weights(odd, a, kb + 1, load_col, t);
    wait_all_but_one();  // block kb's x (its group is the older of the two in flight)
    fence_async_shared();
    __syncthreads();
    multiply_block<kBf16>(even, stage_of(kb), mask, magic, acc, prefetch);
    if (kb + 1 >= end) break;
    if (kb + 2 < end) load_weights(even, a, kb + 2, load_col, t);
    wait_all_but_one();
    fence_async_shared();
    __syncthreads();
    multiply_block<kBf16>(odd, stage_of(kb + 1), mask, magic, acc, prefetch);
  }
  wgmma_wait<0>();
  __syncthreads();  // every stage read: the first bytes hold the span's flag
  finish<kBf16, kTiles>(a, acc, span, col, stores, t, reinterpret_cast<bool*>(xs));
}

}  // namespace lmd_w4a16

// Two CTAs a multiprocessor.
#define LMD_W4A16_WGMMA(dtype, bf16, rows, tiles)                                         \
  extern "C" __global__ void __launch_bounds__(32 * lmd_w4a16::kWarps, 2)                \
      lmd_w4a16_wgmma_##dtype##_m##rows(const W4a16Wide a) {                             \
    lmd_w4a16::w4a16_wgmma<bf16, tiles>(a);                                              \
  }

LMD_W4A16_WGMMA(bf16, true, 32, 4)
LMD_W4A16_WGMMA(bf16, true, 64, 8)
LMD_W4A16_WGMMA(f16, false, 32, 4)
LMD_W4A16_WGMMA(f16, false, 64, 8)
