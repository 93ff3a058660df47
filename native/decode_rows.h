// The products of decode steps' few rows on the tensor cores: W4A16 for 1-16 rows
// (native/kernels/w4a16_rows.cu), 17-32 rows (native/kernels/w4a16_wide.cu) and, on
// Hopper, 33-64 rows (native/kernels/w4a16_wgmma.cu); W4A16 experts in blocks of 8 or 16
// rows (native/kernels/w4a16_experts.cu) and, on Hopper, 64 (w4a16_wgmma.cu's experts
// entry); FP8 weights for 1-16 rows
// (native/kernels/fp8_rows.cu). Their PTX
// is embedded (native/kernels/*.ptx, by setup.py) and JIT-compiled into
// the device's primary context, the one PyTorch uses, so its tensors' addresses and
// streams are valid here and a launch on PyTorch's stream is captured in its CUDA
// graphs like any of PyTorch's own.
#pragma once

#include <cstdint>
#include <string>

namespace lmd {

extern const char kW4a16RowsPtx[];
extern const char kW4a16WidePtx[];
extern const char kW4a16ExpertsPtx[];
extern const char kFp8RowsPtx[];
extern const char kW4a16WgmmaPtx[];

// The kernel's parameter, byte for byte (W4a16Rows in native/kernels/w4a16_params.cuh).
struct W4a16RowsArgs {
  std::uint64_t x, q, s, z, bias, y;  // addresses; bias 0 for none
  std::int32_t m, n, k, x_stride;
  std::uint64_t residual = 0, gamma = 0, summed = 0;  // the normed entries' (0: none)
  float eps = 0.0f;
  std::int32_t gated = 0;  // y [m, n / 2] = silu(x gate^T) * (x up^T), W = gate | up
};
static_assert(sizeof(W4a16RowsArgs) == 96, "must match W4a16Rows in w4a16_params.cuh");

constexpr int kW4a16RowsColumns = 32;  // output columns of a CTA
constexpr int kW4a16NormedMaxK = 16384;  // the normed entries' x row in shared memory
constexpr int kW4a16NormedKPerWarp = 1024;  // their threads' 4 chunks of 8 inputs each

// The most warps a CTA may have for m rows (the kernels' __launch_bounds__).
inline int w4a16_rows_max_warps(int m) { return m <= 8 ? 16 : 8; }

// What is wrong with a rows kernel's count of warps for m rows, or "" (messages named
// `name`; decode_rows_check.cpp).
std::string rows_warps_error(const char* name, int m, int warps);

// The experts kernels' parameter, byte for byte (W4a16Experts in w4a16_ops.cuh).
struct W4a16ExpertsArgs {
  std::uint64_t x, q, s, z, pairs, experts, weights, y;  // addresses; weights 0 for none
  std::int32_t n, k, x_stride, num_pairs, row_div;
  std::int32_t gated;  // y [num_pairs, n / 2] = silu(x gate^T) * (x up^T), W = gate | up
  std::int32_t mixed;  // y [1, n] = sum over p of weights[p] x[p / row_div] W_e^T
};
static_assert(sizeof(W4a16ExpertsArgs) == 96, "must match W4a16Experts in w4a16_ops.cuh");

// What is wrong with an experts launch's arguments, or "": `rows` a block's (8 or 16; 64
// on Hopper), `blocks` the grid's blocks of pairs, `warps` a CTA's (as
// w4a16_rows_max_warps(rows); 0 for 64 rows, whose CTAs are the wgmma kernel's).
std::string w4a16_experts_check(const W4a16ExpertsArgs& args, int rows, int blocks, int warps);

// An 8/16-row experts launch's warps a CTA: `warps`, or mixed, `warps` for each two pairs
// (clamped at 17, past any CTA's 16, so that a wrong count is refused, not overflowed).
int experts_warps(const W4a16ExpertsArgs& args, int warps);

// Enqueues y[p] = x[p / row_div] W_e^T (* weights[p]) for the pairs p of `blocks` blocks of
// `rows` pairs sorted by expert (pairs [blocks * rows] int32, num_pairs for padding, or 0:
// block b holds pair b alone; experts [blocks] int32, -1 for none) on `stream`: N / 32 x
// blocks CTAs of `warps` warps (64 rows: ceil(N / 256) x blocks of the wgmma kernel's),
// the experts' qweight [E, k / 8, n], scales and zeros [E, k / 128, n]. `mixed` (8 rows,
// pairs 0, weights, one block): N / 16 CTAs of ceil(num_pairs / 2) x `warps` warps, y
// [1, n] the pairs' products summed (w4a16_experts.cu). Throws as launch_w4a16_rows.
void launch_w4a16_experts(int ordinal, const W4a16ExpertsArgs& args, int rows, int blocks,
                          bool bf16, int warps, std::uintptr_t stream);

// The split kernels' parameter, byte for byte (W4a16Wide in w4a16_ops.cuh).
struct W4a16WideArgs {
  std::uint64_t x, q, s, z, bias, y, work, counters;  // work and counters: 0 for one split
  std::int32_t m, n, k, x_stride, splits;
  std::int32_t gated;  // w4a16_wgmma only (0 for w4a16_wide): y = silu(gate) * up
};
static_assert(sizeof(W4a16WideArgs) == 88, "must match W4a16Wide in w4a16_ops.cuh");

constexpr int kW4a16WideColumns = 128;  // output columns of a CTA (a span)
constexpr int kW4a16WideThreads = 128;  // 4 warps of 32 columns
constexpr int kW4a16WideMaxRows = 32;

// The wgmma kernel (w4a16_wgmma.cu) takes W4a16WideArgs as its parameter too.
constexpr int kW4a16WgmmaColumns = 256;  // a CTA's span
constexpr int kW4a16WgmmaThreads = 640;  // four warpgroups multiplying, one loading
constexpr int kW4a16WgmmaMaxRows = 64;   // wgmma's n
constexpr int kW4a16WgmmaMaxSplits = 8;  // a CTA adds a share of its span's splits' sums
// Eight stages of x (64 rows x 64 inputs in 16 bits), a ring of eight blocks' words,
// scales and zeros (256 columns), and 1,024 bytes to align the stages to the swizzle's
// period. (The kernel's w4a16_wgmma_load.cuh asserts these wgmma constants against its
// own.)
constexpr int kW4a16WgmmaSharedBytes = 8 * 64 * 128 + 8 * 256 * (64 + 2 + 1) + 1024;

// "" once the kernels are loaded on device `ordinal` (loading them on the first call),
// else why they cannot be: no CUDA, a driver that rejects the PTX, a GPU before sm_80.
std::string w4a16_rows_ready(int ordinal);

// What is wrong with a launch's arguments, or "" (shapes, warps, alignment).
std::string w4a16_rows_check(const W4a16RowsArgs& args, int warps);

// Enqueues y = x W^T (+ b) on `stream` (a CUstream of device `ordinal`): N / 32 CTAs of
// `warps` warps (gated: no bias, n a multiple of 64, y [m, n / 2]). Throws
// std::runtime_error when the kernels are not ready or the launch fails,
// std::invalid_argument for what w4a16_rows_check refuses.
void launch_w4a16_rows(int ordinal, const W4a16RowsArgs& args, bool bf16, int warps,
                       std::uintptr_t stream);

// What is wrong with a normed launch's arguments, or "": w4a16_rows_check's, and one row,
// k <= kW4a16NormedMaxK and kW4a16NormedKPerWarp x warps, gamma given, x, residual, gamma and summed 16-byte aligned,
// summed neither residual nor x.
std::string w4a16_rows_normed_check(const W4a16RowsArgs& args, int warps);

// launch_w4a16_rows for one row of x = RMSNorm(x + residual) (no residual: RMSNorm(x)),
// weight gamma, made by each CTA into shared memory (native/kernels/w4a16_rows.cu); CTA
// 0 stores x + residual to summed when given.
void launch_w4a16_rows_normed(int ordinal, const W4a16RowsArgs& args, bool bf16, int warps,
                              std::uintptr_t stream);

// What is wrong with a wide launch's arguments, or "".
std::string w4a16_wide_check(const W4a16WideArgs& args);

// Enqueues y = x W^T (+ b) for up to 32 rows on `stream`: ceil(N / 128) x splits CTAs;
// with splits > 1, work holds [splits, m, n] float32 and counters ceil(n / 128) zeros
// (zero again after the launch). Throws as launch_w4a16_rows.
void launch_w4a16_wide(int ordinal, const W4a16WideArgs& args, bool bf16, std::uintptr_t stream);

// "" once the wgmma kernel is loaded on device `ordinal` (loading it on the first call),
// else why not: what w4a16_rows_ready says, or not a GPU of compute capability 9.0 (its
// PTX targets sm_90a, which no other GPU runs).
std::string w4a16_wgmma_ready(int ordinal);

// What is wrong with a wgmma launch's arguments, or "".
std::string w4a16_wgmma_check(const W4a16WideArgs& args);

// How many CTAs of the wgmma kernel the device runs at once (its occupancy a
// multiprocessor times their number): a launch of splits > 1 takes at most that many,
// all resident together; throws as launch_w4a16_rows when the kernel is not ready.
int w4a16_wgmma_ctas(int ordinal);

// Enqueues y = x W^T (+ b) for up to 64 rows on `stream`: ceil(N / 256) x splits CTAs.
// With splits > 1 (at most kW4a16WgmmaMaxSplits) a cooperative launch of at most
// w4a16_wgmma_ctas CTAs, whose span's CTAs each add a share of their sums (in work) once
// all have stored theirs (counted in counters: 64 bits a span, 840 more after each
// launch, never reset). Throws as launch_w4a16_rows.
void launch_w4a16_wgmma(int ordinal, const W4a16WideArgs& args, bool bf16,
                        std::uintptr_t stream);

// The FP8 rows kernel's parameter, byte for byte (Fp8Rows in fp8_rows.cu).
struct Fp8RowsArgs {
  std::uint64_t x, w, s, bias, y;  // addresses; bias 0 for none
  std::int32_t m, n, k, x_stride, s_stride, pad;  // s_stride 0: per-channel scales
};
static_assert(sizeof(Fp8RowsArgs) == 64, "must match Fp8Rows in fp8_rows.cu");

// "" once the FP8 kernels are loaded on device `ordinal` (loading them on the first
// call), else why not: no CUDA, a driver before CUDA 12.1, a GPU before sm_89. Separate
// from w4a16_rows_ready: an sm_80 GPU runs the W4A16 kernels and not these.
std::string fp8_rows_ready(int ordinal);

// What is wrong with an FP8 launch's arguments, or "" (shapes, warps, alignment).
std::string fp8_rows_check(const Fp8RowsArgs& args, int warps);

// Enqueues y = x W^T (+ b) for 1-16 rows on `stream`: N / 32 CTAs of `warps` warps (as
// many as w4a16_rows_max_warps allows). Throws as launch_w4a16_rows.
void launch_fp8_rows(int ordinal, const Fp8RowsArgs& args, bool bf16, int warps,
                     std::uintptr_t stream);

}  // namespace lmd
