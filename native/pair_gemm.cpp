#include "pair_gemm.h"

#include <immintrin.h>  // its intrinsics compile inside the AVX-512 region below

#include <algorithm>
#include <cstdint>
#include <vector>

#include "omp_team.h"

namespace lmd {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma")
// GCC 12's AVX-512 headers start some intrinsics from a self-initialized "undefined"
// vector (`__m512 __Y = __Y;`), which -Wmaybe-uninitialized reports at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

constexpr std::int64_t kPairWidth = 16;  // outputs of a pair of panels: one 16-lane vector

// x rounded to bf16, two inputs a 32-bit word (input 2i in the low half, as
// _mm512_dpbf16_ps pairs them), and per group the sum of those rounded inputs.
struct RoundedX {
  std::vector<std::uint32_t> pairs;  // [rows, k / 2]
  std::vector<float> sums;           // [rows, k / group]
};

// Into `out`, whose vectors keep their capacity from call to call (every element is
// written below).
void round_x(const PanelGemm& a, RoundedX& out) {
  const std::int64_t half = a.k / 2, groups = a.k / a.group;
  out.pairs.resize(a.rows * half);
  out.sums.resize(a.rows * groups);
  for (std::int64_t m = 0; m < a.rows; m++) {
    const float* x = a.x + m * a.x_stride;
    std::uint16_t* bf = reinterpret_cast<std::uint16_t*>(out.pairs.data() + m * half);
    for (std::int64_t k = 0; k < a.k; k += 16) {  // k is a multiple of group, itself of 16
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + k));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf + k), reinterpret_cast<const __m256i&>(r));
    }
    for (std::int64_t g = 0; g < groups; g++) {
      float sum = 0.0f;  // of the rounded inputs: the products below meet those
      for (std::int64_t k = g * a.group; k < (g + 1) * a.group; k++) {
        const std::uint32_t bits = std::uint32_t{bf[k]} << 16;  // bf16 -> float32, exact
        float value;
        __builtin_memcpy(&value, &bits, sizeof value);
        sum += value;
      }
      out.sums[m * groups + g] = sum;
    }
  }
}

// Inputs 2i and 2i + 1 of the 16 outputs as bf16 pairs, lane j output j's (input 2i low).
// 4 bits: one 16-byte load, a byte an output (2i's code low), each code made bf16 128 + q
// (exact: q < 16 fits bf16's 7 mantissa bits under 2^7); 8 bits: 32 bytes, two an output,
// each code converted (exact: q < 256 fits bf16's 8 bits of precision).
template <int BITS>
inline __m512bh input_pair(const std::uint8_t* codes, std::int64_t i) {
  if constexpr (BITS == 4) {
    const __m512i both = _mm512_set1_epi32(0x000F000F);  // q_k in bits 0-3, q_k+1 in 16-19
    const __m512i magic = _mm512_set1_epi32(0x43004300);  // bf16 128.0 in each half
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * kPairWidth)));
    // bits 0-3 from v (q_k), 16-19 from v << 12 (q_k+1), then the magic: 0xA8 is
    // C & (A | B), the two codes kept where `both` has them.
    const __m512i q = _mm512_or_si512(
        _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), both, 0xA8), magic);
    return reinterpret_cast<const __m512bh&>(q);
  } else {
    const std::uint8_t* at = codes + i * 2 * kPairWidth;
    const __m512 low = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
    const __m512 high = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16))));
    return _mm512_cvtne2ps_pbh(high, low);  // outputs 0-7's pairs, then 8-15's
  }
}

// R rows of x against panels 2 * pair and 2 * pair + 1 (16 outputs): per pair of inputs
// one dot product per row; per group the sums become d * (sum c x - BIAS sum x) + m sum x,
// c the code as made bf16 (4 bits: 128 + q, BIAS 128; 8 bits: q, BIAS 0).
template <int R, int BITS>
void pair_rows(const PanelGemm& a, const RoundedX& xr, std::int64_t row0, std::int64_t pair) {
  const std::int64_t half = a.k / 2, groups = a.k / a.group, pairs_per_group = a.group / 2;
  const std::uint8_t* codes =
      static_cast<const std::uint8_t*>(a.weights) + pair * half * kPairWidth * (BITS / 4);
  const __m512 bias = _mm512_set1_ps(BITS == 4 ? 128.0f : 0.0f);
  __m512 out[R];
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) out[m] = _mm512_setzero_ps();
  for (std::int64_t g = 0; g < groups; g++) {
    __m512 acc[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
    for (std::int64_t i = g * pairs_per_group; i < (g + 1) * pairs_per_group; i++) {
      const __m512bh wb = input_pair<BITS>(codes, i);
#pragma GCC unroll 8
      for (int m = 0; m < R; m++) {
        const __m512i xp = _mm512_set1_epi32(static_cast<int>(xr.pairs[(row0 + m) * half + i]));
        acc[m] = _mm512_dpbf16_ps(acc[m], wb, reinterpret_cast<const __m512bh&>(xp));
      }
    }
    const std::int64_t at = (2 * pair * groups + g) * 8, at_next = at + groups * 8;
    const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a.scales + at)),
                                        _mm256_loadu_ps(a.scales + at_next), 1);
    const __m512 lo = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a.mins + at)),
                                         _mm256_loadu_ps(a.mins + at_next), 1);
    const __m512 lo_less_bias = _mm512_fnmadd_ps(bias, d, lo);  // m - 128 d
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) {
      const __m512 sx = _mm512_set1_ps(xr.sums[(row0 + m) * groups + g]);
      out[m] = _mm512_fmadd_ps(d, acc[m], _mm512_fmadd_ps(lo_less_bias, sx, out[m]));
    }
  }
  const std::int64_t col0 = pair * kPairWidth;
  const std::int64_t width = std::min<std::int64_t>(kPairWidth, a.n - col0);
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, out[m]);
    store_outputs(a, row0 + m, col0, width, lanes);
  }
}

template <int BITS>
void pairs_range(const PanelGemm& a, const RoundedX& xr, std::int64_t first, std::int64_t last) {
  for (std::int64_t pair = first; pair < last; pair++) {
    std::int64_t row = 0;
    for (; row + 8 <= a.rows; row += 8) pair_rows<8, BITS>(a, xr, row, pair);
    switch (a.rows - row) {
      case 7: pair_rows<7, BITS>(a, xr, row, pair); break;
      case 6: pair_rows<6, BITS>(a, xr, row, pair); break;
      case 5: pair_rows<5, BITS>(a, xr, row, pair); break;
      case 4: pair_rows<4, BITS>(a, xr, row, pair); break;
      case 3: pair_rows<3, BITS>(a, xr, row, pair); break;
      case 2: pair_rows<2, BITS>(a, xr, row, pair); break;
      case 1: pair_rows<1, BITS>(a, xr, row, pair); break;
      default: break;
    }
  }
}

#pragma GCC diagnostic pop
#pragma GCC pop_options

}  // namespace

bool pair_gemm_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
}

void pair_gemm(const PanelGemm& args, int threads) {
  thread_local RoundedX rounded;  // the calling thread's, reused from call to call
  round_x(args, rounded);
  const RoundedX& xr = rounded;  // named here: inside the team, `rounded` is each thread's own
  const std::int64_t pairs = (args.n + kPairWidth - 1) / kPairWidth;
  for_shares(pairs, threads, [&args, &xr](std::int64_t first, std::int64_t last) {
    if (args.bits == 4) {
      pairs_range<4>(args, xr, first, last);
    } else {
      pairs_range<8>(args, xr, first, last);
    }
  });
}

}  // namespace lmd
