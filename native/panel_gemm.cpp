#include "panel_gemm.h"

#include <immintrin.h>  // its intrinsics compile inside the AVX2 region below

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "omp_team.h"

namespace lmd {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// body(std::integral_constant<int, R>{}, row0) for each group of R rows of x: 8 at a
// time, then the rest (R a template argument of the kernels: their accumulators).
template <typename Body>
void by_row_groups(std::int64_t rows, Body&& body) {
  std::int64_t row = 0;
  for (; row + 8 <= rows; row += 8) body(std::integral_constant<int, 8>{}, row);
  switch (rows - row) {
    case 7: body(std::integral_constant<int, 7>{}, row); break;
    case 6: body(std::integral_constant<int, 6>{}, row); break;
    case 5: body(std::integral_constant<int, 5>{}, row); break;
    case 4: body(std::integral_constant<int, 4>{}, row); break;
    case 3: body(std::integral_constant<int, 3>{}, row); break;
    case 2: body(std::integral_constant<int, 2>{}, row); break;
    case 1: body(std::integral_constant<int, 1>{}, row); break;
    default: break;
  }
}

// A panel's operands, for the kernels to hold as locals: read through `a`, GCC reloads
// the fields and keeps the accumulators in memory every step of the loop.
struct Operands {
  std::int64_t k_end, x_stride, group, groups;
  const float* x;  // the first of the rows
  const float* w32;  // the panel, by how W is held
  const std::uint8_t* w8;
  const std::uint32_t* w4;
};

template <int BITS>
Operands operands(const PanelGemm& a, std::int64_t row0, std::int64_t panel) {
  const std::int64_t group = BITS == 32 ? a.k : a.group;
  return {a.k,
          a.x_stride,
          group,
          a.k / group,
          a.x + row0 * a.x_stride,
          static_cast<const float*>(a.weights) + panel * a.k * 8,
          static_cast<const std::uint8_t*>(a.weights) + panel * a.k * 8,
          static_cast<const std::uint32_t*>(a.weights) + panel * a.k};
}

// R rows of x (R <= 8) against one panel: out[m][j] = x[m] . W[8 p + j] (+ b), the
// panel's valid outputs (width <= 8) written. BITS: how W is held (panel_gemm.h).
template <int R, int BITS>
void panel_rows(const PanelGemm& a, std::int64_t row0, std::int64_t panel) {
  const auto [k_end, x_stride, group, groups, x, w32, w8, w4] = operands<BITS>(a, row0, panel);
  // The next panel's weights, a cache line at a time as this one's are read (a panel is
  // a stream too short for the hardware prefetcher: panel_pair_rows says more).
  constexpr std::int64_t k_bytes = BITS;  // one input of a panel: 8 outputs of BITS / 8 bytes
  const char* ahead = static_cast<const char*>(a.weights) + (panel + 1) * k_end * k_bytes;
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
      if ((k * k_bytes) % 64 == 0) _mm_prefetch(ahead + k * k_bytes, _MM_HINT_T0);
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
    store_outputs(a, row0 + m, col0, width, lanes);  // the last panel may be cut short by n
  }
}

// Panels [first, last): each meets every row of x, 8 rows at a time, while it is in cache.
template <int BITS>
void panels_range(const PanelGemm& a, std::int64_t first, std::int64_t last) {
  for (std::int64_t p = first; p < last; p++) {
    by_row_groups(a.rows, [&](auto r, std::int64_t row) {
      panel_rows<decltype(r)::value, BITS>(a, row, p);
    });
  }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma")
// GCC 12's AVX-512 headers start some intrinsics from a self-initialized "undefined"
// vector (`__m512 __Y = __Y;`), which -Wmaybe-uninitialized reports at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Two 8-lane halves as one 16-lane vector.
inline __m512 join(__m256 low, __m256 high) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
}

// panel_rows for panels p and p + 1 at once, one 16-lane vector (lanes 0-7: panel p's
// outputs, 8-15: p + 1's): per input the two panels' slices joined, then one 16-wide
// FMA per row. Each output gets the same operations in the same order as in
// panel_rows, so the product is bitwise panel_rows'; where a core runs 512-bit FMAs at
// full width, it is twice the FMAs an instruction.
template <int R, int BITS>
void panel_pair_rows(const PanelGemm& a, std::int64_t row0, std::int64_t panel) {
  const auto [k_end, x_stride, group, groups, x, w32, w8, w4] = operands<BITS>(a, row0, panel);
  const std::int64_t next = k_end * 8;  // panel p + 1, in floats or bytes (w4: k_end words)
  // The next pair's weights, a cache line at a time as this pair's own are read: a panel
  // is a short stream (2-4 KB at SmolLM2's widths as codes), too short for the hardware
  // prefetcher to run ahead of (cold gate|up codes at ~12 GB/s of the ~70 this machine
  // reads without it; docs/benchmarks.md).
  constexpr std::int64_t k_bytes = BITS;
  const char* ahead = static_cast<const char*>(a.weights) + (panel + 2) * k_end * k_bytes;
  const __m512i shifts =
      _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i nibble = _mm512_set1_epi32(0xF);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
  for (std::int64_t g = 0; g < groups; g++) {
    __m512 d = _mm512_setzero_ps();
    __m512 lo = _mm512_setzero_ps();
    if constexpr (BITS != 32) {
      const std::int64_t at = (panel * groups + g) * 8, at_next = at + groups * 8;
      d = join(_mm256_loadu_ps(a.scales + at), _mm256_loadu_ps(a.scales + at_next));
      lo = join(_mm256_loadu_ps(a.mins + at), _mm256_loadu_ps(a.mins + at_next));
    }
    for (std::int64_t k = g * group; k < (g + 1) * group; k++) {
      if ((k * k_bytes) % 64 == 0) {
        _mm_prefetch(ahead + k * k_bytes, _MM_HINT_T0);
        _mm_prefetch(ahead + (k_end + k) * k_bytes, _MM_HINT_T0);
      }
      __m512 wk;
      if constexpr (BITS == 32) {
        wk = join(_mm256_loadu_ps(w32 + k * 8), _mm256_loadu_ps(w32 + next + k * 8));
      } else {
        __m512i q;
        if constexpr (BITS == 8) {
          const __m128i both = _mm_unpacklo_epi64(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w8 + k * 8)),
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w8 + next + k * 8)));
          q = _mm512_cvtepu8_epi32(both);
        } else {
          const __m512i words = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(w4[k]))),
              _mm256_set1_epi32(static_cast<int>(w4[k_end + k])), 1);
          q = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), nibble);
        }
        wk = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, lo);
      }
#pragma GCC unroll 8
      for (int m = 0; m < R; m++) {
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * x_stride + k]), wk, acc[m]);
      }
    }
  }
  const std::int64_t col0 = panel * 8;
  const std::int64_t width = std::min<std::int64_t>(16, a.n - col0);
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[m]);
    store_outputs(a, row0 + m, col0, width, lanes);
  }
}

// Pairs of panels [first, last) (pair i: panels 2i, 2i + 1), a last lone panel by the
// 8-lane kernel.
template <int BITS>
void pairs_range(const PanelGemm& a, std::int64_t first, std::int64_t last) {
  const std::int64_t panels = (a.n + 7) / 8;
  for (std::int64_t pair = first; pair < last; pair++) {
    const std::int64_t p = 2 * pair;
    if (p + 1 == panels) {
      panels_range<BITS>(a, p, p + 1);
      continue;
    }
    by_row_groups(a.rows, [&](auto r, std::int64_t row) {
      panel_pair_rows<decltype(r)::value, BITS>(a, row, p);
    });
  }
}

#pragma GCC diagnostic pop
#pragma GCC pop_options

bool wide_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

bool& wide_enabled() {
  static bool enabled = wide_supported();
  return enabled;
}

}  // namespace

bool panel_gemm_wide(int enable) {
  if (enable >= 0) wide_enabled() = enable != 0 && wide_supported();
  return wide_enabled();
}

void panel_gemm(const PanelGemm& args, int threads) {
  const std::int64_t panels = (args.n + 7) / 8;
  if (wide_enabled()) {
    for_shares((panels + 1) / 2, threads, [&args](std::int64_t first, std::int64_t last) {
      switch (args.bits) {
        case 4: pairs_range<4>(args, first, last); break;
        case 8: pairs_range<8>(args, first, last); break;
        default: pairs_range<32>(args, first, last); break;
      }
    });
    return;
  }
  for_shares(panels, threads, [&args](std::int64_t first, std::int64_t last) {
    switch (args.bits) {
      case 4: panels_range<4>(args, first, last); break;
      case 8: panels_range<8>(args, first, last); break;
      default: panels_range<32>(args, first, last); break;
    }
  });
}

}  // namespace lmd
