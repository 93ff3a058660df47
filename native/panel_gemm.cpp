#include "panel_gemm.h"

#include <immintrin.h>  // its intrinsics compile inside the AVX2 region below

#include <algorithm>

#include "omp_team.h"

namespace lmd {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

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

#pragma GCC pop_options

}  // namespace

void panel_gemm(const PanelGemm& args, int threads) {
  for_shares((args.n + 7) / 8, threads,
             [&args](std::int64_t first, std::int64_t last) { panels_range(args, first, last); });
}

}  // namespace lmd
