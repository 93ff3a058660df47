#include "panel_gemm.h"

#include <immintrin.h>  // its intrinsics compile inside the AVX2 region below

#include <algorithm>
#include <cstdint>

#include "omp_team.h"

namespace lmd {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// R rows of x (R <= 8) against one panel: out[m][j] = x[m] . W[8 p + j] (+ b), the
// panel's valid outputs (width <= 8) written. BITS: how W is held (panel_gemm.h).
template <int R, int BITS>
void panel_rows(const PanelGemm& a, std::int64_t row0, std::int64_t panel) {
  // Locals, not a's fields: read through the reference, GCC reloads them and keeps the
  // accumulators in memory every step of the loop.
  const std::int64_t k_end = a.k;
  const std::int64_t x_stride = a.x_stride;
  const std::int64_t group = BITS == 32 ? k_end : a.group;
  const float* x = a.x + row0 * x_stride;
  const auto* w32 = static_cast<const float*>(a.weights) + panel * k_end * 8;
  const auto* w8 = static_cast<const std::uint8_t*>(a.weights) + panel * k_end * 8;
  const auto* w4 = static_cast<const std::uint32_t*>(a.weights) + panel * k_end;
  const std::int64_t groups = k_end / group;
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibble = _mm256_set1_epi32(0xF);
  __m256 acc[R];
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_ps();
  for (std::int64_t g = 0; g < groups; g++) {
    __m256 d = _mm256_setzero_ps();
    __m256 lo = _mm256_setzero_ps();
    if constexpr (BITS != 32) {
      d = _mm256_loadu_ps(a.scales + (panel * groups + g) * 8);
      lo = _mm256_loadu_ps(a.mins + (panel * groups + g) * 8);
    }
    for (std::int64_t k = g * group; k < (g + 1) * group; k++) {
      __m256 wk;  // inputs k of the panel's 8 outputs
      if constexpr (BITS == 32) {
        wk = _mm256_loadu_ps(w32 + k * 8);
      } else {
        __m256i q;
        if constexpr (BITS == 8) {
          q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w8 + k * 8)));
        } else {
          q = _mm256_and_si256(
              _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w4[k])), shifts), nibble);
        }
        wk = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, lo);
      }
#pragma GCC unroll 8  // unrolled early, so that the accumulators live in registers
      for (int m = 0; m < R; m++) {
        acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * x_stride + k), wk, acc[m]);
      }
    }
  }
  const std::int64_t col0 = panel * 8;
  const std::int64_t width = std::min<std::int64_t>(8, a.n - col0);
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[m]);
    float* out = a.y + (row0 + m) * a.y_stride + col0;
    for (std::int64_t j = 0; j < width; j++) {  // the last panel may be cut short by n
      out[j] = lanes[j] + (a.bias != nullptr ? a.bias[col0 + j] : 0.0f);
    }
  }
}

// Panels [first, last): each meets every row of x, 8 rows at a time, while it is in cache.
template <int BITS>
void panels_range(const PanelGemm& a, std::int64_t first, std::int64_t last) {
  for (std::int64_t p = first; p < last; p++) {
    std::int64_t row = 0;
    for (; row + 8 <= a.rows; row += 8) panel_rows<8, BITS>(a, row, p);
    switch (a.rows - row) {
      case 7: panel_rows<7, BITS>(a, row, p); break;
      case 6: panel_rows<6, BITS>(a, row, p); break;
      case 5: panel_rows<5, BITS>(a, row, p); break;
      case 4: panel_rows<4, BITS>(a, row, p); break;
      case 3: panel_rows<3, BITS>(a, row, p); break;
      case 2: panel_rows<2, BITS>(a, row, p); break;
      case 1: panel_rows<1, BITS>(a, row, p); break;
      default: break;
    }
  }
}

#pragma GCC pop_options

}  // namespace

void panel_gemm(const PanelGemm& args, int threads) {
  for_shares((args.n + 7) / 8, threads, [&args](std::int64_t first, std::int64_t last) {
    switch (args.bits) {
      case 4: panels_range<4>(args, first, last); break;
      case 8: panels_range<8>(args, first, last); break;
      default: panels_range<32>(args, first, last); break;
    }
  });
}

}  // namespace lmd
