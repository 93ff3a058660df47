// W4A16 product for 17-32 rows (a decode step of a larger batch): y = x W^T (+ b), x
// [M <= 32, K] in bf16 or fp16, W 4-bit in groups of 128 inputs in the layout that
// w4a16_rows.cu reads (daemon/engine/turbo/quant/w4a16.py).
//
// The weights are mma.sync.m16n8k16's A operand as in w4a16_rows.cu (w4a16_ops.cuh: a
// warp's 32 columns as two 16-row tiles, the codes made into operands in registers), x
// the B operand, 8 rows a tile, 4 tiles. Here a lane loads word rows 2t, 2t+1,
// 2t+8, 2t+9 (still four 16-byte loads), so A's column kappa is input 16 j + kappa: the
// inputs of a step in their own order, which is the order ldmatrix hands B's fragments
// out of a row-major tile of x in shared memory (one ldmatrix.x4 is two tiles' B).
//
// At 32 rows each CTA reading all of x for itself (as w4a16_rows.cu's lanes do) would
// read 4 times the weights' bytes from L2; so a CTA is 4 warps side by side, 128
// columns, and x goes once a CTA through shared memory: a block of 128 inputs of all
// rows (rows past M repeat row M - 1; their outputs are not stored) by cp.async, two
// stages, the next block's weights into a second set of registers while the current one
// is multiplied. Float32 sums of exact products, scaled once a group, as w4a16_rows.cu.
//
// Grid: N / 128 column spans by `splits` ranges of K (enough CTAs for every
// multiprocessor to hold two). With one split a CTA writes y. With more, each writes its
// float32 sums to work [splits, M, N], and the last CTA of a span to finish (a counter
// per span, reset by that CTA for the next launch) adds the splits in split order, adds
// the bias and writes y: deterministic, and nothing for the host to synchronize (decode
// steps capture it in their CUDA graphs). A span's counter is in use only during a launch;
// launches that share a counter array must be ordered (one stream).
//
// Not compiled by setup.py: its PTX (native/kernels/w4a16_wide.ptx) is embedded and JIT-
// compiled by the driver at run time (native/decode_rows.cpp). After editing, run
// native/kernels/make_ptx.sh (needs nvcc) to regenerate that file.
#include <stdint.h>

#include "w4a16_ops.cuh"

namespace lmd_w4a16 {

constexpr int kWarps = 4;
constexpr int kSpan = 32 * kWarps;  // output columns a CTA
constexpr int kPitch = 136;  // a staged row of x in 16-bit words: ldmatrix's 8 rows hit
                             // 8 distinct 16-byte bank groups (272 bytes apart)

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

__device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], uint32_t at) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
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

// Block kb of x, all kRows rows, into a stage: 16 bytes a cp.async.
template <int kRows>
__device__ __forceinline__ void stage_x(uint32_t stage, const W4a16Wide& a, int kb) {
#pragma unroll
  for (int i = 0; i < kRows * 16 / (32 * kWarps); ++i) {
    const int c = threadIdx.x + 32 * kWarps * i;
    const int row = c >> 4;
    const int piece = c & 15;
    const uint16_t* from =
        a.x + static_cast<size_t>(min(row, a.m - 1)) * a.x_stride + 128 * kb + 8 * piece;
    cp_async16(stage + 2 * (row * kPitch + 8 * piece), from);
  }
}

// B out of the stage: ldmatrix.x4's lane l points at row l % 8 of matrix l / 8 = (tile 2i
// + l / 16, inputs 16 j + 8 (l / 8 % 2) ..); registers 0, 1 are tile 2i's B fragment, 2,
// 3 tile 2i+1's.
template <bool kBf16, int kTiles>
__device__ __forceinline__ void multiply_block(const Weights& b, uint32_t stage, int lane,
                                               uint32_t mask, uint32_t magic,
                                               float (&acc)[kTiles][2][4]) {
  const uint32_t rows =
      stage + 2 * ((8 * (lane >> 4) + (lane & 7)) * kPitch + 8 * ((lane >> 3) & 1));
  const auto step_b = [&](int j, int i, uint2 (&bx)[2]) {
    uint32_t r[4];
    ldmatrix4(r, rows + 2 * (16 * i * kPitch + 16 * j));
    bx[0] = make_uint2(r[0], r[1]);
    bx[1] = make_uint2(r[2], r[3]);
  };
  multiply_steps<kBf16, kTiles, 2>(b.w, b.s, b.z, mask, magic, step_b, acc);
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

template <bool kBf16, int kTiles>
__device__ __forceinline__ void w4a16_wide(const W4a16Wide& a) {
  constexpr int kRows = 8 * kTiles;
  __shared__ __align__(16) uint16_t xs[2][kRows * kPitch];
  __shared__ bool last;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int span = blockIdx.x;
  const int col = span * kSpan + 32 * warp + 4 * g;
  const bool stores = col < a.n;            // a warp's 32 columns are all in or all out
  const int load_col = stores ? col : 4 * g;  // a span's last warps past N load span 0's
  const int blocks = a.k / 128;
  const int first = static_cast<int>(static_cast<long long>(blockIdx.y) * blocks / a.splits);
  const int end = static_cast<int>(static_cast<long long>(blockIdx.y + 1) * blocks / a.splits);
  const uint32_t stages[2] = {shared_address(xs[0]), shared_address(xs[1])};
  uint32_t mask = 0x000F000Fu;  // in registers, not immediates (w4a16_ops.cuh's and_or)
  uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
  asm("" : "+r"(mask), "+r"(magic));

  float acc[kTiles][2][4] = {};
  Weights even;
  Weights odd;
  stage_x<kRows>(stages[0], a, first);
  commit();
  load_weights(even, a, first, load_col, t);
  // Block kb in `cur` and stage s: block kb + 1's x and weights fetched into the others
  // first, then kb multiplied.
  const auto turn = [&](Weights& cur, Weights& next, int s, int kb) {
    if (kb + 1 < end) {
      stage_x<kRows>(stages[s ^ 1], a, kb + 1);
      load_weights(next, a, kb + 1, load_col, t);
    }
    commit();
    wait_all_but_one();
    __syncthreads();
    multiply_block<kBf16>(cur, stages[s], lane, mask, magic, acc);
    __syncthreads();  // stage s is free again
  };
  for (int kb = first; kb < end; kb += 2) {  // blocks first, first + 2, ... in `even`
    turn(even, odd, 0, kb);
    if (kb + 1 >= end) break;
    turn(odd, even, 1, kb + 1);
  }

  // A lane holds, for x row 8 nt + 2t + e, columns col .. col + 3: y's with one split,
  // else this split's float32 sums in work.
  if (stores) {
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = 8 * nt + 2 * t + e;
        if (row >= a.m) continue;
        float4 v =
            make_float4(acc[nt][0][e], acc[nt][0][2 + e], acc[nt][1][e], acc[nt][1][2 + e]);
        if (a.splits == 1) {
          v = plus_bias<kBf16>(v, a, col);
          store8(a.y + static_cast<size_t>(row) * a.n + col, pack4<kBf16>(v.x, v.y, v.z, v.w));
        } else {
          float* to = a.work + (static_cast<size_t>(blockIdx.y) * a.m + row) * a.n + col;
          asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(to), "f"(v.x),
                       "f"(v.y), "f"(v.z), "f"(v.w)
                       : "memory");
        }
      }
    }
  }
  if (a.splits == 1) return;
  // The last CTA of the span to get here (a counter a span) adds the splits' sums in
  // split order and resets the counter for the next launch.
  __threadfence();  // this CTA's sums are visible before its count is
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(a.counters + span, 1u) == static_cast<unsigned>(a.splits) - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  sum_splits<kBf16>(a, span);
  if (threadIdx.x == 0) a.counters[span] = 0;
}

}  // namespace lmd_w4a16

// Three CTAs a multiprocessor: at most 168 registers a thread (ptxas: 158).
#define LMD_W4A16_WIDE(dtype, bf16, rows, tiles)                                          \
  extern "C" __global__ void __launch_bounds__(32 * lmd_w4a16::kWarps, 3)                \
      lmd_w4a16_wide_##dtype##_m##rows(const W4a16Wide a) {                              \
    lmd_w4a16::w4a16_wide<bf16, tiles>(a);                                               \
  }

LMD_W4A16_WIDE(bf16, true, 32, 4)
LMD_W4A16_WIDE(f16, false, 32, 4)
