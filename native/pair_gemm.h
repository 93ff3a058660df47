// Decode-sized products of float32 rows with coded weights on x86 CPUs with bf16 dot
// products (AVX512-BF16): y = x W^T (+ b), W[o][i] = q * d + m with the codes of
// panel_gemm.h (a GGUF's Q4_1, 4 bits, or Q8_0, 8 bits), for the torch backend's linears
// at decode when its GEMMs take bf16 inputs (engine/torch_backend/linear.py,
// cpu_matmul_dtype). x is rounded to bf16; the codes are exact in bf16, so each dot
// product of a pair of inputs is one instruction where panel_gemm spends a float32
// dequantization and a multiply-add per input; the sums are float32, and per group of
// inputs d and m apply in float32: sum_i (q_i d + m) x_i = d sum_i q_i x_i + m sum_i x_i.
//
// The codes are laid out for it at load (weight_codes.code_pairs), pair p of panels
// (outputs 16 p + j), inputs 2i and 2i + 1: 4 bits, [ceil(n / 16), k / 2, 16] bytes, input
// 2i's code in a byte's low nibble, 2i + 1's in its high one; 8 bits, [ceil(n / 16), k / 2,
// 16, 2], the two codes side by side. d and m as panel_gemm's, [n / 8, k / group, 8], for
// an even number of panels (a padded one of zeros).
#pragma once

#include <cstdint>

#include "panel_gemm.h"

namespace lmd {

// The arguments are panel_gemm's (panel_gemm.h), `weights` the codes laid out as above
// and `bits` 4 or 8.

// Does this CPU run pair_gemm (AVX-512 F, BW, DQ and BF16)?
bool pair_gemm_supported();

// The product on `threads` threads of torch's OpenMP team (omp_team.h).
void pair_gemm(const PanelGemm& args, int threads);

}  // namespace lmd
