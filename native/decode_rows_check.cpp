// The argument checks of the decode kernels' launches (native/decode_rows.h): what each
// kernel's shapes, warps and loads ask, before any CUDA call.
#include <algorithm>
#include <string>

#include "decode_rows.h"

namespace lmd {

std::string rows_warps_error(const char* name, int m, int warps) {
  if (warps >= 1 && warps <= w4a16_rows_max_warps(m)) return "";
  return std::string(name) + ": warps must be 1.." + std::to_string(w4a16_rows_max_warps(m));
}

int experts_warps(const W4a16ExpertsArgs& a, int warps) {
  return a.mixed ? std::min(warps, 17) * ((a.num_pairs + 1) / 2) : warps;
}

std::string w4a16_rows_check(const W4a16RowsArgs& a, int warps) {
  if (a.m < 1 || a.m > 16 || a.n < 1 || a.n % kW4a16RowsColumns || a.k < 128 || a.k % 128 ||
      a.x_stride < a.k) {
    return "w4a16_rows: m must be 1..16, n a multiple of 32, k of 128 and x_stride >= k";
  }
  const std::string warps_error = rows_warps_error("w4a16_rows", a.m, warps);
  if (!warps_error.empty()) return warps_error;
  // 16-byte word loads, 8-byte x, scale and bias loads, 4-byte zero loads.
  if (!a.x || !a.q || !a.s || !a.z || !a.y || a.x % 8 || a.x_stride % 4 || a.q % 16 ||
      a.s % 8 || a.z % 4 || a.y % 2 || a.bias % 2) {
    return "w4a16_rows: a null or misaligned address";
  }
  if (a.gated && (a.bias || a.n % 64)) return "w4a16_rows: gated takes no bias and n a multiple of 64";
  return "";
}

std::string w4a16_rows_normed_check(const W4a16RowsArgs& a, int warps) {
  const std::string wrong = w4a16_rows_check(a, warps);
  if (!wrong.empty()) return wrong;
  if (a.m != 1 || a.k > kW4a16NormedMaxK || a.k > kW4a16NormedKPerWarp * warps) {
    return "w4a16_rows_normed: m must be 1 and k at most " + std::to_string(kW4a16NormedMaxK) +
           " and " + std::to_string(kW4a16NormedKPerWarp) + " a warp";
  }
  // 16-byte loads of x, residual and gamma, stores of summed; summed written while every
  // CTA reads x and residual.
  if (!a.gamma || a.x % 16 || a.residual % 16 || a.gamma % 16 || a.summed % 16)
    return "w4a16_rows_normed: a null or misaligned address";
  if (a.summed && (a.summed == a.residual || a.summed == a.x))
    return "w4a16_rows_normed: summed must not be x or the residual";
  return "";
}

std::string w4a16_experts_check(const W4a16ExpertsArgs& a, int rows, int blocks, int warps) {
  if ((rows != 8 && rows != 16 && rows != kW4a16WgmmaMaxRows) || blocks < 1 || blocks > 65535 ||
      a.n < 1 || a.n % kW4a16RowsColumns || a.k < 128 || a.k % 128 || a.x_stride < a.k ||
      a.num_pairs < 1 || a.row_div < 1) {
    return "w4a16_experts: rows must be 8, 16 or 64, blocks 1..65535, n a multiple of 32, k "
           "of 128, x_stride >= k, num_pairs and row_div >= 1";
  }
  const bool wgmma = rows == kW4a16WgmmaMaxRows;  // that kernel's CTAs, its 16-byte copies
  if (wgmma && (warps != 0 || !a.pairs))
    return "w4a16_experts: 64 rows take sorted pairs and warps 0";
  if (a.gated && (a.n % 64 || a.weights || a.mixed))
    return "w4a16_experts: gated takes no weights and n a multiple of 64, and is not mixed";
  if (a.mixed && (rows != 8 || a.pairs || !a.weights || blocks != 1 || a.num_pairs > 16))
    return "w4a16_experts: mixed takes 8 rows, no sorted pairs, weights, a block, <= 16 pairs";
  const std::string warps_error =
      wgmma ? "" : rows_warps_error("w4a16_experts", rows, experts_warps(a, warps));
  if (!warps_error.empty()) return warps_error;
  if (!a.pairs && !a.mixed && blocks != a.num_pairs)
    return "w4a16_experts: without sorted pairs, a block a pair (blocks == num_pairs)";
  // w4a16_rows' loads (the wgmma kernel copies x, scales and zeros 16 bytes at a time and
  // stores y 4), and 4-byte pair ids (or none), experts and routing weights.
  const int x_align = wgmma ? 16 : 8, s_align = wgmma ? 16 : 8, z_align = wgmma ? 16 : 4;
  if (!a.x || !a.q || !a.s || !a.z || !a.experts || !a.y || a.x % x_align ||
      a.x_stride % (x_align / 2) || a.q % 16 || a.s % s_align || a.z % z_align || a.pairs % 4 ||
      a.experts % 4 || a.weights % 4 || a.y % (wgmma ? 4 : 2)) {
    return "w4a16_experts: a null or misaligned address";
  }
  return "";
}

std::string fp8_rows_check(const Fp8RowsArgs& a, int warps) {
  if (a.m < 1 || a.m > 16 || a.n < 1 || a.n % kW4a16RowsColumns || a.k < 128 || a.k % 128 ||
      a.x_stride < a.k || (a.s_stride != 0 && a.s_stride < a.k / 128)) {
    return "fp8_rows: m must be 1..16, n a multiple of 32, k of 128, x_stride >= k and "
           "s_stride 0 or >= k / 128";
  }
  const std::string warps_error = rows_warps_error("fp8_rows", a.m, warps);
  if (!warps_error.empty()) return warps_error;
  // 16-byte weight and x loads, 4-byte scales, 2-byte bias and y.
  if (!a.x || !a.w || !a.s || !a.y || a.x % 16 || a.x_stride % 8 || a.w % 16 || a.s % 4 ||
      a.y % 2 || a.bias % 2) {
    return "fp8_rows: a null or misaligned address";
  }
  return "";
}

}  // namespace lmd
