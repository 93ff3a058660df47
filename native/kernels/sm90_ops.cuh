// Hopper (sm_90a) device helpers of native/kernels/w4a16_wgmma.cu: mbarriers, cp.async
// into them, shared-memory operand descriptors, wgmma itself and loads through L2.
#pragma once

#include <stdint.h>

namespace lmd_sm90 {

__device__ __forceinline__ uint32_t smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// One of the barrier's expected arrivals, made when this thread's cp.asyncs so far are
// complete.
__device__ __forceinline__ void arrive_after_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// 16 bytes from global memory, or 16 zero bytes when !read (`from` still a valid address).
__device__ __forceinline__ void cp_async16(uint32_t to, const void* from, bool read = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(from),
               "r"(read ? 16 : 0)
               : "memory");
}

// A K-major operand of 128-byte rows in the 128-byte swizzle, 8 rows 1,024 bytes apart:
// the address / 16 in bits 0-13, the stride byte offset / 16 in bits 32-45, the swizzle
// in bits 62-63 (the leading byte offset, bits 16-29, is unused by this layout). Step kk
// of a stage (inputs 16 kk ..) starts 32 kk bytes into the rows; the swizzle applies to
// the address bits, so the tiles sit on 1,024-byte boundaries.
__device__ __forceinline__ uint64_t descriptor(uint32_t at) {
  return static_cast<uint64_t>((at & 0x3FFFFu) >> 4) | (1ull << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Pins the accumulators in their registers across the asynchronous products: the
// compiler may not move or redefine them between a wgmma and its wait (ptxas would
// serialize the wgmmas if it did).
__device__ __forceinline__ void hold(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// d = A (64 x 16, registers a: a warp's 16 rows as mma.m16n8k16's A) B (16 x 64, K-major
// in shared memory, descriptor {b_lo, b_hi}: the halves passed apart, so that a step's
// offset is one 32-bit add) (+ d when `accumulate`): d in wgmma's layout, element
// 4 i + e of a thread (warp w, lane l) at row 16 w + l / 4 + 8 (e / 2), column 8 i +
// 2 (l % 4) + e % 2.
#define LMD_WGMMA_M64N64K16_RS(T)                                                   \
  asm volatile(                                                                      \
      "{\n.reg .pred p;\n.reg .b64 b;\nsetp.ne.b32 p, %38, 0;\nmov.b64 b, {%36, %37};\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {"                    \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "      \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
      "}, {%32, %33, %34, %35}, b, p, 1, 1, 0;\n}"                                \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(b_hi), "r"(accumulate))

// 16 bytes of global memory from L2 (not L1, which may hold another CTA's stale lines).
__device__ __forceinline__ float4 load_l2_16(const float* from) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(from)
               : "memory");
  return v;
}

template <bool kBf16>
__device__ __forceinline__ void wgmma(float (&d)[32], const uint32_t (&a)[4], uint32_t b_lo,
                                      uint32_t b_hi, uint32_t accumulate) {
  if constexpr (kBf16) {
    LMD_WGMMA_M64N64K16_RS("bf16");
  } else {
    LMD_WGMMA_M64N64K16_RS("f16");
  }
}

}  // namespace lmd_sm90
