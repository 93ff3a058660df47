// Decode-sized float32 products on x86 CPUs with AVX2 and FMA: y = x W^T (+ b) for a
// few rows of x, the torch backend's linears at decode (daemon/engine/torch_backend/
// linear.py). W is stored in panels of 8 outputs, [ceil(N / 8)][K][8], so that a panel
// streams through the cache in one pass while 8 rows of x meet it: per input k, one
// 32-byte load of the panel and 8 FMAs, one per row, into 8 accumulators held in
// registers. On the 2-core dev machine this streams weights at its memory bandwidth
// where oneDNN's blocked GEMM, at 8 rows, ran 1.5-2.5x slower (docs/benchmarks.md).
//
// W may also be held as codes: W[o][i] = q * d + m, q an unsigned code of 4 or 8 bits,
// d and m float32 per group of inputs and output (a GGUF's Q4_1 or Q8_0 weight, its
// codes re-derived exactly from its float32 form: torch_backend/weight_codes.py). Each
// weight becomes its float32 value in registers (q * d is exact, so one FMA gives
// q * d + m rounded once, as the float32 weight was) and meets x in the same order:
// bitwise the float32 product, from 1/8 or 1/4 of the weight bytes plus the groups'
// d and m.
//
// Threads: the panels are split over the OpenMP team of the runtime the process has
// already loaded (torch's libgomp), so the product runs on torch's own intra-op threads,
// not on threads of ours that would compete with them for the cores; with no OpenMP
// runtime loaded, on the calling thread alone.
#pragma once

#include <cstdint>

namespace lmd {

struct PanelGemm {
  const float* x;       // [rows, k], rows x_stride floats apart
  std::int64_t rows;
  std::int64_t k;       // with codes, a multiple of group
  std::int64_t x_stride;
  const void* weights;  // bits 32: float [ceil(n / 8), k, 8], outputs past n zero;
                        // 8: uint8 codes [ceil(n / 8), k, 8];
                        // 4: uint32 [ceil(n / 8), k], output j's code in bits 4j..4j+3
  int bits;             // 32, 8 or 4
  const float* scales;  // codes: d [ceil(n / 8), k / group, 8]; else unused
  const float* mins;    // codes: m [ceil(n / 8), k / group, 8]; else unused
  std::int64_t group;   // codes: inputs per d and m
  std::int64_t n;
  float* y;             // [rows, n], rows y_stride floats apart
  std::int64_t y_stride;
  const float* bias;    // [n] or nullptr
};

// Row `row` of y from `col0`, `width` outputs: lanes[j] plus the bias, where there is one.
inline void store_outputs(const PanelGemm& a, std::int64_t row, std::int64_t col0,
                          std::int64_t width, const float* lanes) {
  float* out = a.y + row * a.y_stride + col0;
  for (std::int64_t j = 0; j < width; j++) {
    out[j] = lanes[j] + (a.bias != nullptr ? a.bias[col0 + j] : 0.0f);
  }
}

// Computes the product on `threads` threads (see above). Requires cpu_kernels_supported() (omp_team.h).
void panel_gemm(const PanelGemm& args, int threads);

// Whether panel_gemm takes two panels a 512-bit vector (AVX-512F and DQ: on by default
// where the CPU has them; bitwise the same product): `enable` 1 or 0 sets it (1 only
// where supported), -1 leaves it; returns the setting.
bool panel_gemm_wide(int enable);

}  // namespace lmd
