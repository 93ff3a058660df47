#include "panel_gemm.h"

#include <immintrin.h>  // its intrinsics compile inside the AVX2 region below

#include <algorithm>
#include <cstdint>

#include "omp_team.h"

namespace lmd {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// The accumulators of R rows against one panel into y (+ b): its valid outputs (the last
// panel may be cut short by n).
template <int R>
void store_rows(float* y, std::int64_t y_stride, const float* bias, std::int64_t n,
                const __m256 (&acc)[R], std::int64_t row0, std::int64_t panel) {
  const std::int64_t col0 = panel * 8;
  const std::int64_t width = std::min<std::int64_t>(8, n - col0);
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[m]);
    float* out = y + (row0 + m) * y_stride + col0;
    for (std::int64_t j = 0; j < width; j++) {
      out[j] = lanes[j] + (bias != nullptr ? bias[col0 + j] : 0.0f);
    }
  }
}

// R rows of x (R <= 8) against one panel: out[m][j] = x[m] . W[8 p + j] (+ b), the
// panel's valid outputs (width <= 8) written.
template <int R>
void panel_rows(const PanelGemm& a, std::int64_t row0, std::int64_t panel) {
  // Locals, not a's fields: read through the reference, GCC reloads them and keeps the
  // accumulators in memory every step of the loop.
  const std::int64_t k_end = a.k;
  const std::int64_t x_stride = a.x_stride;
  const float* x = a.x + row0 * x_stride;
  const float* w = a.panels + panel * k_end * 8;
  __m256 acc[R];
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < k_end; k++) {
    const __m256 wk = _mm256_loadu_ps(w + k * 8);  // inputs k of the panel's 8 outputs
#pragma GCC unroll 8  // unrolled early, so that the accumulators live in registers
    for (int m = 0; m < R; m++) {
      acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * x_stride + k), wk, acc[m]);
    }
  }
  store_rows<R>(a.y, a.y_stride, a.bias, a.n, acc, row0, panel);
}

// Panels [first, last): each meets every row of x, 8 rows at a time, while it is in cache.
void panels_range(const PanelGemm& a, std::int64_t first, std::int64_t last) {
  for (std::int64_t p = first; p < last; p++) {
    std::int64_t row = 0;
    for (; row + 8 <= a.rows; row += 8) panel_rows<8>(a, row, p);
    switch (a.rows - row) {
      case 7: panel_rows<7>(a, row, p); break;
      case 6: panel_rows<6>(a, row, p); break;
      case 5: panel_rows<5>(a, row, p); break;
      case 4: panel_rows<4>(a, row, p); break;
      case 3: panel_rows<3>(a, row, p); break;
      case 2: panel_rows<2>(a, row, p); break;
      case 1: panel_rows<1>(a, row, p); break;
      default: break;
    }
  }
}

// Panel_rows on codes: the 8 weights of input k decoded from `bits`-bit codes.
template <int R, int BITS>
void code_rows(const PanelGemmCodes& a, std::int64_t row0, std::int64_t panel) {
  const std::int64_t k_end = a.k;
  const std::int64_t group = a.group;
  const std::int64_t x_stride = a.x_stride;
  const float* x = a.x + row0 * x_stride;
  const std::int64_t groups = k_end / group;
  const float* scales = a.scales + panel * groups * 8;
  const float* mins = a.mins + panel * groups * 8;
  const auto* codes4 = static_cast<const std::uint32_t*>(a.codes) + panel * k_end;
  const auto* codes8 = static_cast<const std::uint8_t*>(a.codes) + panel * k_end * 8;
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibble = _mm256_set1_epi32(0xF);
  __m256 acc[R];
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_ps();
  for (std::int64_t g = 0; g < groups; g++) {
    const __m256 d = _mm256_loadu_ps(scales + g * 8);
    const __m256 lo = _mm256_loadu_ps(mins + g * 8);
    for (std::int64_t k = g * group; k < (g + 1) * group; k++) {
      __m256i q;
      if constexpr (BITS == 4) {
        q = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(codes4[k])), shifts), nibble);
      } else {
        q = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes8 + k * 8)));
      }
      const __m256 wk = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, lo);
#pragma GCC unroll 8
      for (int m = 0; m < R; m++) {
        acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * x_stride + k), wk, acc[m]);
      }
    }
  }
  store_rows<R>(a.y, a.y_stride, a.bias, a.n, acc, row0, panel);
}

template <int BITS>
void code_panels_range(const PanelGemmCodes& a, std::int64_t first, std::int64_t last) {
  for (std::int64_t p = first; p < last; p++) {
    std::int64_t row = 0;
    for (; row + 8 <= a.rows; row += 8) code_rows<8, BITS>(a, row, p);
    switch (a.rows - row) {
      case 7: code_rows<7, BITS>(a, row, p); break;
      case 6: code_rows<6, BITS>(a, row, p); break;
      case 5: code_rows<5, BITS>(a, row, p); break;
      case 4: code_rows<4, BITS>(a, row, p); break;
      case 3: code_rows<3, BITS>(a, row, p); break;
      case 2: code_rows<2, BITS>(a, row, p); break;
      case 1: code_rows<1, BITS>(a, row, p); break;
      default: break;
    }
  }
}

#pragma GCC pop_options

}  // namespace

void panel_gemm(const PanelGemm& args, int threads) {
  for_shares((args.n + 7) / 8, threads,
             [&args](std::int64_t first, std::int64_t last) { panels_range(args, first, last); });
}

void panel_gemm_codes(const PanelGemmCodes& args, int threads) {
  for_shares((args.n + 7) / 8, threads, [&args](std::int64_t first, std::int64_t last) {
    if (args.bits == 4) {
      code_panels_range<4>(args, first, last);
    } else {
      code_panels_range<8>(args, first, last);
    }
  });
}

}  // namespace lmd
