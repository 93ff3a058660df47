// W4A16 product for 17-64 rows with mma.sync.m16n8k16 (any GPU from sm_80): the feed of
// w4a16_wide.cuh's kernel. The weights are the A operand (w4a16_ops.cuh: a warp's 32
// columns as two 16-row tiles), x the B operand, 8 rows a tile, 4 or 8 tiles: one
// ldmatrix.x4 out of the stage's core matrices is two tiles' B fragments of a step.
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_wide.ptx) is embedded and JIT-
// compiled by the driver at run time (native/w4a16_rows.cpp). After editing it or the
// .cuh files, run native/kernels/make_ptx.sh (needs nvcc) to regenerate that file.
#include "w4a16_wide.cuh"

namespace lmd_w4a16 {

__device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], uint32_t at) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}

struct MmaSync {
  static constexpr bool kAsyncProxy = false;

  // acc[nt][h][d] += tile h's A x tile nt's B, step by step.
  template <bool kBf16, int kTiles, int kParity, typename Mid>
  __device__ __forceinline__ void block(const Weights& b, uint32_t stage, int lane, uint32_t mask,
                                        uint32_t magic, float (&acc)[kTiles][2][4],
                                        const Mid& mid) const {
    uint32_t neg[4];
    uint32_t scale[4];
    block_constants<kBf16>(b, neg, scale);
    // ldmatrix.x4: lane l points at row l % 8 of matrix l / 8 = (tile 2i + l / 16, inputs
    // 16 j + 8 (l / 8 % 2) ..): core matrix (2i + l / 16, 2j + l / 8 % 2). Registers 0, 1
    // are tile 2i's B fragment, 2, 3 tile 2i+1's.
    const uint32_t rows = stage + ((lane >> 4) * 16 + ((lane >> 3) & 1)) * 128 + (lane & 7) * 16;
#pragma unroll
    for (int byte = 0; byte < 4; ++byte) {
      uint32_t pairs[2][4];
      gather_pairs(b.w, byte, pairs);
#pragma unroll
      for (int odd = 0; odd < 2; ++odd) {
        const int j = 2 * byte + odd;
        uint32_t a[2][4];
        scaled_operands<kBf16>(pairs, odd, mask, magic, neg, scale, a);
#pragma unroll
        for (int i = 0; i < kTiles / 2; ++i) {
          uint32_t bx[4];
          ldmatrix4(bx, rows + 32 * 128 * i + 256 * j);
          const uint2 lo = make_uint2(bx[0], bx[1]);
          const uint2 hi = make_uint2(bx[2], bx[3]);
          mma<kBf16>(acc[2 * i][0], a[0], lo);
          mma<kBf16>(acc[2 * i][1], a[1], lo);
          mma<kBf16>(acc[2 * i + 1][0], a[0], hi);
          mma<kBf16>(acc[2 * i + 1][1], a[1], hi);
        }
        if (j == 1) mid();  // every warp is past the block before
      }
    }
  }

  __device__ __forceinline__ void drain() const {}
};

}  // namespace lmd_w4a16

// Three CTAs a multiprocessor: at most 168 registers a thread.
#define LMD_W4A16_WIDE(dtype, bf16, rows, tiles)                                          \
  extern "C" __global__ void __launch_bounds__(32 * lmd_w4a16::kWarps, 1)                \
      lmd_w4a16_wide_##dtype##_m##rows(const W4a16Wide a) {                              \
    lmd_w4a16::w4a16_wide<bf16, tiles, lmd_w4a16::MmaSync>(a);                           \
  }

LMD_W4A16_WIDE(bf16, true, 32, 4)
LMD_W4A16_WIDE(bf16, true, 64, 8)
LMD_W4A16_WIDE(f16, false, 32, 4)
LMD_W4A16_WIDE(f16, false, 64, 8)
