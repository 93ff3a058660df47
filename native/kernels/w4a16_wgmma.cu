// W4A16 product for 17-64 rows on Hopper (sm_90a): the feed of w4a16_wide.cuh's kernel
// by wgmma.mma_async, which runs a warpgroup's m64 x n x k16 product asynchronously at
// the tensor cores' full rate (mma.sync, w4a16_wide.cu, reaches a fraction of it at 64
// rows), A from registers and B from shared memory.
//
// The CTA is one warpgroup: warp w's A tiles h = 0, 1 (its 32 columns, w4a16_ops.cuh) are
// rows 16 w .. 16 w + 15 of the warpgroup's two m64 A operands, whose register layout a
// warp holds as mma.m16n8k16's A, and the accumulators come back in mma's D layout, so
// w4a16_wide.cuh's finish stores them. B is the stage's x, K-major core matrices without
// swizzle.
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_wgmma.ptx, ISA 8.0, sm_90a) is
// embedded and JIT-compiled by the driver at run time (native/w4a16_rows.cpp), on a GPU
// of compute capability 9.0 only. After editing it or the .cuh files, run
// native/kernels/make_ptx.sh.
#include "w4a16_wide.cuh"

namespace lmd_w4a16 {

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

// A block's 8 steps made into operands first (64 registers, a set for each parity), then
// its 16 wgmmas in one group; the group before is waited on after this one is issued, so
// the tensor cores run one block while the next block's operands are made.
struct Wgmma {
  static constexpr bool kAsyncProxy = true;
  uint32_t a[2][8][2][4];

  template <bool kBf16, int kTiles, int kParity, typename Mid>
  __device__ __forceinline__ void block(const Weights& b, uint32_t stage, int, uint32_t mask,
                                        uint32_t magic, float (&acc)[kTiles][2][4],
                                        const Mid& mid) {
    uint32_t neg[4];
    uint32_t scale[4];
    block_constants<kBf16>(b, neg, scale);
#pragma unroll
    for (int byte = 0; byte < 4; ++byte) {
      uint32_t pairs[2][4];
      gather_pairs(b.w, byte, pairs);
#pragma unroll
      for (int odd = 0; odd < 2; ++odd) {
        scaled_operands<kBf16>(pairs, odd, mask, magic, neg, scale, a[kParity][2 * byte + odd]);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      wgmma<kBf16, kTiles>(acc, 0, a[kParity][j][0], b_descriptor(stage, j));
      wgmma<kBf16, kTiles>(acc, 1, a[kParity][j][1], b_descriptor(stage, j));
    }
    wgmma_commit();
    wgmma_wait<1>();  // the block before: its operands and its stage are free
    mid();
  }

  __device__ __forceinline__ void drain() const { wgmma_wait<0>(); }
};

}  // namespace lmd_w4a16

// Three CTAs a multiprocessor: at most 168 registers a thread.
#define LMD_W4A16_WGMMA(dtype, bf16, rows, tiles)                                         \
  extern "C" __global__ void __launch_bounds__(32 * lmd_w4a16::kWarps, 1)                \
      lmd_w4a16_wgmma_##dtype##_m##rows(const W4a16Wide a) {                             \
    lmd_w4a16::w4a16_wide<bf16, tiles, lmd_w4a16::Wgmma>(a);                             \
  }

LMD_W4A16_WGMMA(bf16, true, 32, 4)
LMD_W4A16_WGMMA(bf16, true, 64, 8)
LMD_W4A16_WGMMA(f16, false, 32, 4)
LMD_W4A16_WGMMA(f16, false, 64, 8)
