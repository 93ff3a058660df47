// The W4A16 product for decode rows on the tensor cores (native/kernels/w4a16_rows.cu):
// its PTX is embedded (native/kernels/w4a16_rows.ptx, by setup.py) and JIT-compiled into
// the device's primary context, the one PyTorch uses, so its tensors' addresses and
// streams are valid here and a launch on PyTorch's stream is captured in its CUDA
// graphs like any of PyTorch's own.
#pragma once

#include <cstdint>
#include <string>

namespace lmd {

extern const char kW4a16RowsPtx[];

// The kernel's parameter, byte for byte (W4a16Rows in the .cu).
struct W4a16RowsArgs {
  std::uint64_t x, q, s, z, bias, y;  // addresses; bias 0 for none
  std::int32_t m, n, k, x_stride;
};
static_assert(sizeof(W4a16RowsArgs) == 64, "must match W4a16Rows in w4a16_rows.cu");

constexpr int kW4a16RowsColumns = 32;  // output columns of a CTA

// The most warps a CTA may have for m rows (the kernels' __launch_bounds__).
inline int w4a16_rows_max_warps(int m) { return m <= 8 ? 16 : 8; }

// "" once the kernels are loaded on device `ordinal` (loading them on the first call),
// else why they cannot be: no CUDA, a driver that rejects the PTX, a GPU before sm_80.
std::string w4a16_rows_ready(int ordinal);

// What is wrong with a launch's arguments, or "" (shapes, warps, alignment).
std::string w4a16_rows_check(const W4a16RowsArgs& args, int warps);

// Enqueues y = x W^T (+ b) on `stream` (a CUstream of device `ordinal`): N / 32 CTAs of
// `warps` warps. Throws std::runtime_error when the kernels are not ready or the launch
// fails, std::invalid_argument for what w4a16_rows_check refuses.
void launch_w4a16_rows(int ordinal, const W4a16RowsArgs& args, bool bf16, int warps,
                       std::uintptr_t stream);

}  // namespace lmd
