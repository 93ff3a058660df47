// Decode-sized products of float32 rows with 4-bit weights on x86 CPUs with bf16 dot
// products (AVX512-BF16): y = x W^T (+ b), W[o][i] = q * d + m as panel_gemm.h holds a
// GGUF's Q4_1 codes, for the torch backend's linears at decode when its GEMMs take bf16
// inputs (engine/torch_backend/linear.py, cpu_matmul_dtype). x is rounded to bf16; the
// codes are exact in bf16 (as 128 + q), so each dot product of a pair of inputs is one
// instruction where panel_gemm spends a float32 dequantization and a multiply-add per
// input; the sums are float32, and per group of inputs d and m apply in float32:
// sum_i (q_i d + m) x_i = d * sum_i q_i x_i + m * sum_i x_i.
//
// The codes are laid out for it at load, [ceil(n / 16), k / 2, 16] bytes: pair p of
// panels, inputs 2i and 2i + 1, output 16 p + j: the code of input 2i in the byte's low
// nibble, of 2i + 1 in its high one. d and m as panel_gemm's, [n / 8, k / group, 8], for
// an even number of panels (a padded one of zeros).
#pragma once

#include <cstdint>

namespace lmd {

struct NibbleGemm {
  const float* x;             // [rows, k], rows x_stride floats apart
  std::int64_t rows;
  std::int64_t k;             // a multiple of group, itself a multiple of 16
  std::int64_t x_stride;
  const std::uint8_t* codes;  // [ceil(n / 16), k / 2, 16]
  const float* scales;        // d [2 ceil(n / 16), k / group, 8]
  const float* mins;          // m, the same
  std::int64_t group;
  std::int64_t n;
  float* y;                   // [rows, n], rows y_stride floats apart
  std::int64_t y_stride;
  const float* bias;          // [n] or nullptr
};

// Does this CPU run nibble_gemm (AVX-512 F, BW, DQ and BF16)?
bool nibble_gemm_supported();

// The product on `threads` threads of torch's OpenMP team (omp_team.h).
void nibble_gemm(const NibbleGemm& args, int threads);

}  // namespace lmd
