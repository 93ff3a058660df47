// Device helpers of the tensor-core decode kernels (w4a16_rows.cu, w4a16_wide.cu,
// fp8_rows.cu): loads, the conversions of 4-bit codes into 16-bit tensor-core operands,
// the mma itself, and the rows kernels' loop over K and their warps' sums.
//
// Both kernels take W as the 16 x 16 A operand of mma.sync.m16n8k16 (16 output columns
// by 16 inputs) and a lane's four columns 4g .. 4g+3 as two 16-row tiles (rows g, g+8 of
// tile h are columns 4g + 2h, 4g + 2h + 1). A lane loads four word rows of a block of 128
// inputs, 16 bytes each (its four columns); word row r holds nibble j of input 16 j + r,
// so step j of the block is nibble j of those rows. Which four rows a lane loads decides
// the order of the inputs within a step (A's column order), and the B operand (x) must
// follow it: see each kernel.
//
// A nibble becomes a 16-bit float by its bits: in bf16 0x4300 | q is 128 + q exactly (in
// fp16 0x6400 | q is 1024 + q), two at a time in a 32-bit register (one prmt gathers the
// byte holding nibble j from two words, a shift for odd j, one lop3 masks and ORs in the
// magic), and one packed fma subtracts magic + zero, exactly.
#pragma once

#include <stdint.h>

#include "w4a16_params.cuh"

namespace lmd_w4a16 {  // named: an anonymous one mangles in a hash of the path

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint4 load16(const uint32_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 load8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t load4(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// (v & mask) | bits in one lop3: with both constants as immediates it takes two.
__device__ __forceinline__ uint32_t and_or(uint32_t v, uint32_t mask, uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(v), "r"(mask), "r"(bits));
  return d;
}

__device__ __forceinline__ uint32_t lane_of(const uint4& v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

template <bool kBf16>
__device__ __forceinline__ float to_float(uint32_t bits16) {
  if (kBf16) return __uint_as_float(bits16 << 16);
  float f;
  const uint16_t h = static_cast<uint16_t>(bits16);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

template <bool kBf16>
__device__ __forceinline__ uint16_t from_float(float f) {
  uint16_t h;
  if (kBf16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  }
  return h;
}

// silu(gate) * up for a gate|up product's two sums, each rounded to x's dtype first as a
// separate product and silu_and_mul would read them (the experts' and wgmma's gated
// stores).
template <bool kBf16>
__device__ __forceinline__ float silu_mul(float gate, float up) {
  const float g = to_float<kBf16>(from_float<kBf16>(gate));
  const float u = to_float<kBf16>(from_float<kBf16>(up));
  return g / (1.0f + __expf(-g)) * u;
}

// v - (magic + zero) in both halves, exact: v * 1 + (-(magic + zero)).
template <bool kBf16>
__device__ __forceinline__ uint32_t minus(uint32_t v, uint32_t neg) {
  uint32_t d;
  if (kBf16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x3F803F80u), "r"(neg));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x3C003C00u), "r"(neg));
  }
  return d;
}

// v * s in both halves, one rounding (+ -0 leaves the product as it is).
template <bool kBf16>
__device__ __forceinline__ uint32_t times(uint32_t v, uint32_t s, uint32_t minus_zero) {
  uint32_t d;
  if (kBf16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(s), "r"(minus_zero));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(s), "r"(minus_zero));
  }
  return d;
}

template <bool kBf16>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint2 b) {
  if (kBf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
  }
}

// A lane's four columns' constants of a block: -(magic + zero) in both halves of a
// register, and the scale in float32.
template <bool kBf16>
__device__ __forceinline__ void column_constants(uint2 s, uint32_t z, uint32_t (&neg)[4],
                                                 float (&scale)[4]) {
  constexpr uint32_t kNegMagic = kBf16 ? 0xC300u : 0xE400u;  // -(magic), one half
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    neg[c] = (kNegMagic | ((z >> (8 * c)) & 0xFFu)) * 0x10001u;
    const uint32_t pair = c < 2 ? s.x : s.y;
    scale[c] = to_float<kBf16>(c % 2 ? pair >> 16 : pair & 0xFFFFu);
  }
}

// Byte `byte` of the lane's word rows 2p (low half) and 2p + 1 (high half) for A's
// register r = 2p + (column parity) of tile h: nibbles 2 byte and 2 byte + 1 of each.
__device__ __forceinline__ void gather_pairs(const uint4 (&w)[4], int byte,
                                             uint32_t (&pairs)[2][4]) {
  const uint32_t sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // A's registers: (row, inputs) = (c0, p0), (c1, p0),
      const int c = 2 * h + (r & 1);  //   (c0, p1), (c1, p1) of the tile's columns
      const int p = r >> 1;
      pairs[h][r] = prmt(lane_of(w[2 * p], c), lane_of(w[2 * p + 1], c), sel);
    }
  }
}

// The two A tiles of step 2 byte + odd from gather_pairs' registers: q - zero, exact.
template <bool kBf16>
__device__ __forceinline__ void operands(const uint32_t (&pairs)[2][4], int odd, uint32_t mask,
                                         uint32_t magic, const uint32_t (&neg)[4],
                                         uint32_t (&a)[2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t v = and_or(odd ? pairs[h][r] >> 4 : pairs[h][r], mask, magic);
      a[h][r] = minus<kBf16>(v, neg[2 * h + (r & 1)]);
    }
  }
}

// acc[nt][h][d] += a block of 128 inputs for a lane: tile h's (columns 4g + 2h, 4g + 2h +
// 1) mma output d for x rows of tile nt (d 0, 1 column 4g + 2h at rows 8 nt + 2t, +1; d 2,
// 3 column 4g + 2h + 1). w: the lane's four word rows, s and z its columns' scales and
// zeros; step_b(j, i, bx) sets bx[u] to B's fragment of tile kPer i + u at step j (kPer
// tiles a fetch). The group's exact products are summed in float32 and scaled once.
template <bool kBf16, int kTiles, int kPer, typename StepB>
__device__ __forceinline__ void multiply_steps(const uint4 (&w)[4], uint2 s, uint32_t z,
                                               uint32_t mask, uint32_t magic,
                                               const StepB& step_b,
                                               float (&acc)[kTiles][2][4]) {
  uint32_t neg[4];
  float scale[4];
  column_constants<kBf16>(s, z, neg, scale);
  float part[kTiles][2][4] = {};
#pragma unroll
  for (int byte = 0; byte < 4; ++byte) {  // steps 2 byte (low nibbles), 2 byte + 1 (high)
    uint32_t pairs[2][4];
    gather_pairs(w, byte, pairs);
#pragma unroll
    for (int odd = 0; odd < 2; ++odd) {
      const int j = 2 * byte + odd;
      uint32_t a[2][4];
      operands<kBf16>(pairs, odd, mask, magic, neg, a);
#pragma unroll
      for (int i = 0; i < kTiles / kPer; ++i) {
        uint2 bx[kPer];
        step_b(j, i, bx);
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
          mma<kBf16>(part[kPer * i + u][0], a[0], bx[u]);
          mma<kBf16>(part[kPer * i + u][1], a[1], bx[u]);
        }
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int d = 0; d < 4; ++d) acc[nt][h][d] += scale[2 * h + d / 2] * part[nt][h][d];
    }
  }
}

struct Nothing {
  __device__ void operator()() const {}
};

// A CTA's warps over K, warp w taking blocks w, w + warps, ...: two blocks in turn, each
// loaded while the other is multiplied (no copy between them). load(b, kb) fills a
// Block, multiply(b, kb) adds it to the warp's sums; first() runs in every warp once its
// first block's loads are issued (a CTA's shared work while they are in flight).
template <typename Block, typename Load, typename Multiply, typename First = Nothing>
__device__ __forceinline__ void over_blocks(int warp, int warps, int blocks, const Load& load,
                                            const Multiply& multiply,
                                            const First& first = First()) {
  Block even;
  Block odd;
  if (warp < blocks) load(even, warp);
  first();
  for (int kb = warp; kb < blocks; kb += 2 * warps) {
    if (kb + warps < blocks) load(odd, kb + warps);
    multiply(even, kb);
    if (kb + warps >= blocks) break;
    if (kb + 2 * warps < blocks) load(even, kb + 2 * warps);
    multiply(odd, kb + warps);
  }
}

// The warps' sums acc[nt][h][d] (mma output d of tile h for x tile nt) into shared memory
// `sums` ([warps][kTiles * 8][32] floats), for warp_sum once all have.
template <int kTiles>
__device__ __forceinline__ void stash_sums(float* sums, const float (&acc)[kTiles][2][4]) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const float* flat = &acc[0][0][0];
#pragma unroll
  for (int e = 0; e < kTiles * 8; ++e) sums[(warp * kTiles * 8 + e) * 32 + lane] = flat[e];
  __syncthreads();
}

// Lane l's sum e over warps first .. last - 1, in warp order (kSums: kTiles * 8).
template <int kSums>
__device__ __forceinline__ float warp_sum(const float* sums, int e, int l, int first, int last) {
  float v = 0.0f;
  for (int w = first; w < last; ++w) v += sums[(w * kSums + e) * 32 + l];
  return v;
}

// The warps' sums added in warp order (stash_sums, warp_sum), each handed to
// emit(row, lane, h, d, v) with its x row (row 8 nt + 2t + d % 2 of the CTA's rows, e =
// 8 nt + 4 h + d); `kLanes` 16: lanes 0-15's only, emit(row, lane, h, d, v, v of lane +
// 16) (a CTA whose lanes 16-31 hold up's columns for lanes 0-15's gate ones).
template <int kTiles, int kLanes = 32, typename Emit>
__device__ __forceinline__ void sum_warps(float* sums, const float (&acc)[kTiles][2][4],
                                          const Emit& emit) {
  constexpr int kSums = kTiles * 8;
  stash_sums<kTiles>(sums, acc);
  const int warps = blockDim.x >> 5;
  for (int i = threadIdx.x; i < kSums * kLanes; i += blockDim.x) {
    const int e = i / kLanes;
    const int l = i % kLanes;
    const int row = 8 * (e / 8) + 2 * (l & 3) + (e & 1);
    if constexpr (kLanes == 32) {
      emit(row, l, (e / 4) % 2, e % 4, warp_sum<kSums>(sums, e, l, 0, warps));
    } else {
      emit(row, l, (e / 4) % 2, e % 4, warp_sum<kSums>(sums, e, l, 0, warps),
           warp_sum<kSums>(sums, e, l + 16, 0, warps));
    }
  }
}

// sum_warps, and each output of a row under m written to y [m, n]: column(lane, h, d) is
// its output column, finish(v, column) its value in float32 before the bias and the
// rounding to x's dtype.
template <bool kBf16, int kTiles, typename Column, typename Finish>
__device__ __forceinline__ void store_sums(float* sums, const float (&acc)[kTiles][2][4],
                                           int m, int n, const uint16_t* bias, uint16_t* y,
                                           const Column& column, const Finish& finish) {
  sum_warps<kTiles>(sums, acc, [&](int row, int l, int h, int d, float v) {
    const int col = column(l, h, d);
    if (row >= m) return;
    v = finish(v, col);
    if (bias != nullptr) v += to_float<kBf16>(bias[col]);
    y[static_cast<size_t>(row) * n + col] = from_float<kBf16>(v);
  });
}

// A rows kernel lane's share of block kb of 128 inputs: word rows 4t .. 4t+3 at its 4
// columns from col, their scales and zeros; RowsBlock adds its x rows' inputs 16 j + 4t ..
// 4t+3 each step j.
struct WordsBlock {
  uint4 w[4];
  uint2 s;
  uint32_t z;

  __device__ __forceinline__ void load(const uint32_t* q, const uint16_t* s_, const uint8_t* z_,
                                       int n, int kb, int t, int col) {
    const uint32_t* words = q + static_cast<size_t>(16 * kb + 4 * t) * n + col;
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = load16(words + static_cast<size_t>(i) * n);
    const size_t at = static_cast<size_t>(kb) * n + col;
    s = load8(s_ + at);
    z = load4(z_ + at);
  }
};
template <int kTiles>
struct RowsBlock : WordsBlock {
  uint2 x[kTiles][8];
};

// A rows kernel warp's sums acc over 32 columns from col0 of W (words q [k / 8, n], scales
// s, zeros z [k / 128, n]): blocks of 128 inputs warp, warp + warps, ..., each loaded while
// the last is multiplied. x_row(nt): the lane's x row of tile nt (rows 8 nt + g) from its
// input 4t. Lanes 16-31 read their columns `upper` further (up's half for gate's 16).
template <bool kBf16, int kTiles, typename XRow>
__device__ __forceinline__ void rows_warp(const uint32_t* q, const uint16_t* s, const uint8_t* z,
                                          int n, int k, int col0, const XRow& x_row, int warp,
                                          int warps, float (&acc)[kTiles][2][4], int upper = 0) {
  const int lane = threadIdx.x & 31;
  const int t = lane & 3;
  const int col = col0 + 4 * (lane >> 2) + (lane >= 16 ? upper : 0);
  // In registers, not immediates (see and_or); the loop keeps them.
  uint32_t mask = 0x000F000Fu;
  uint32_t magic = kBf16 ? 0x43004300u : 0x64006400u;
  asm("" : "+r"(mask), "+r"(magic));
  over_blocks<RowsBlock<kTiles>>(
      warp, warps, k / 128,
      [&](RowsBlock<kTiles>& b, int kb) {
        b.load(q, s, z, n, kb, t, col);
#pragma unroll
        for (int nt = 0; nt < kTiles; ++nt) {
          const uint16_t* x = x_row(nt) + 128 * kb;
#pragma unroll
          for (int j = 0; j < 8; ++j) b.x[nt][j] = load8(x + 16 * j);
        }
      },
      [&](const RowsBlock<kTiles>& b, int) {
        const auto step_b = [&](int j, int nt, uint2 (&bx)[1]) { bx[0] = b.x[nt][j]; };
        multiply_steps<kBf16, kTiles, 1>(b.w, b.s, b.z, mask, magic, step_b, acc);
      });
}

// A rows kernel's CTA (w4a16_rows.cu, w4a16_experts.cu): rows_warp for each warp over K,
// the sums added in warp order (sum_warps<kTiles, kLanes>: emit(row, lane, h, d, v...)).
template <bool kBf16, int kTiles, int kLanes = 32, typename XRow, typename Emit>
__device__ __forceinline__ void rows_cta(const uint32_t* q, const uint16_t* s, const uint8_t* z,
                                         int n, int k, int col0, const XRow& x_row,
                                         float* sums, const Emit& emit, int upper = 0) {
  float acc[kTiles][2][4] = {};
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  rows_warp<kBf16, kTiles>(q, s, z, n, k, col0, x_row, warp, warps, acc, upper);
  sum_warps<kTiles, kLanes>(sums, acc, emit);
}

}  // namespace lmd_w4a16

// The four entry points of a rows kernel, NAME_{bf16,f16}_m{8,16}(const ARGS a) running
// FN<bf16, tiles>(a): up to 8 rows one x tile and 16 warps a CTA, up to 16 two and 8
// (their registers: two blocks in flight).
#define LMD_ROWS_ENTRY(name, args, fn, dtype, bf16, rows, tiles)                         \
  extern "C" __global__ void __launch_bounds__(512 / tiles)                              \
      name##_##dtype##_m##rows(const args a) {                                           \
    fn<bf16, tiles>(a);                                                                  \
  }
#define LMD_ROWS_ENTRIES(name, args, fn)          \
  LMD_ROWS_ENTRY(name, args, fn, bf16, true, 8, 1)  \
  LMD_ROWS_ENTRY(name, args, fn, bf16, true, 16, 2) \
  LMD_ROWS_ENTRY(name, args, fn, f16, false, 8, 1)  \
  LMD_ROWS_ENTRY(name, args, fn, f16, false, 16, 2)
