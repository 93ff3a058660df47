// The parameters of the W4A16 decode kernels, each passed by value as a kernel's one
// argument and matched byte for byte by native/decode_rows.h (W4a16RowsArgs,
// W4a16WideArgs, W4a16ExpertsArgs).
#pragma once

#include <stdint.h>

// w4a16_rows.cu's: y = x W^T (+ b) for 1-16 rows; `gated` (no bias): W = gate | up and y
// [m, n / 2] = silu(x gate^T) * (x up^T). The normed entries (one row) take x =
// RMSNorm(x + residual) with weight gamma: residual null for none, summed [k] or null
// receives x + residual.
struct W4a16Rows {
  const uint16_t* x;     // [m, k], row stride x_stride elements; 8-byte aligned rows
  const uint32_t* q;     // [k / 8, n]
  const uint16_t* s;     // [k / 128, n]
  const uint8_t* z;      // [k / 128, n]
  const uint16_t* bias;  // [n] or null
  uint16_t* y;           // [m, n] (n / 2 gated)
  int m, n, k, x_stride;
  const uint16_t* residual;  // normed: [k] or null; x, residual, gamma, summed 16-byte aligned
  const uint16_t* gamma;     // normed: [k]
  uint16_t* summed;          // normed: [k] or null, x + residual (never residual itself)
  float eps;
  int gated;
};

// The parameter of the kernels that split K over CTAs (w4a16_wide.cu, w4a16_wgmma.cu;
// native/decode_rows.h: W4a16WideArgs); work and counters serve the splits' sums.
struct W4a16Wide {
  const uint16_t* x;     // [m, k], row stride x_stride elements; 16-byte aligned rows
  const uint32_t* q;     // [k / 8, n]
  const uint16_t* s;     // [k / 128, n]
  const uint8_t* z;      // [k / 128, n]
  const uint16_t* bias;  // [n] or null
  uint16_t* y;           // [m, n]
  float* work;           // [splits, m, n] when splits > 1
  unsigned* counters;    // a span's: w4a16_wide's 0 between launches, wgmma's 64-bit
  int m, n, k, x_stride, splits;
  int gated;  // w4a16_wgmma: y [m, n / 2] = silu(x gate^T) * (x up^T), W = gate | up
};

// The parameter of the experts kernels (w4a16_experts.cu for blocks of 8 or 16 pairs,
// w4a16_wgmma.cu's experts entry for 64; native/decode_rows.h: W4a16ExpertsArgs).
struct W4a16Experts {
  const uint16_t* x;       // [rows, k], row stride x_stride; 8-byte aligned rows (64: 16)
  const uint32_t* q;       // [E, k / 8, n]
  const uint16_t* s;       // [E, k / 128, n]
  const uint8_t* z;        // [E, k / 128, n]
  const int32_t* pairs;    // [blocks * rows] ids sorted by expert; null: block b = pair b
  const int32_t* experts;  // [blocks] the expert of each block, -1 for none
  const float* weights;    // [num_pairs] routing weights, or null
  uint16_t* y;             // [num_pairs, n] (n / 2 gated)
  int n, k, x_stride, num_pairs, row_div;
  int gated;  // y [num_pairs, n / 2] = silu(x gate^T) * (x up^T), W = gate | up
  int mixed;  // one token's pairs in one CTA's warps, y [1, n] their weighted sum
};
