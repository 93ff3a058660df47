// The single PYBIND11_MODULE of lmd._native. Each transport or helper lives in its
// own file; this one only binds them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>

#include "bindings.h"
#include "cuda_driver.h"
#include "omp_team.h"
#include "paged_attention.h"
#include "pair_gemm.h"
#include "panel_gemm.h"
#include "decode_rows.h"

namespace py = pybind11;

namespace {

// What is wrong with a product's arguments (nullptr: nothing). panel_gemm takes float32
// panels (bits 32) or codes in groups of any size, pair_gemm codes in groups of 16s.
const char* wrong_args(const lmd::PanelGemm& a, bool pairs) {
  const bool coded = a.bits == 4 || a.bits == 8;
  const std::int64_t unit = pairs ? 16 : 1;  // pair_gemm rounds x to bf16 16 inputs at a time
  const bool grouped = a.group >= unit && a.group % unit == 0 && a.k % a.group == 0;
  if (a.rows < 0 || a.k < 1 || a.n < 1 || a.x_stride < a.k || a.y_stride < a.n || !a.x ||
      !a.weights || !a.y || (!coded && (pairs || a.bits != 32)) ||
      (coded && (!grouped || !a.scales || !a.mins))) {
    return pairs ? "pair_gemm: bad shapes, strides, bits, group or pointers"
                 : "panel_gemm: bad shapes, strides, bits or pointers";
  }
  return nullptr;
}

// panel_gemm or pair_gemm on addresses from Python, checked first, the GIL released.
template <void (*kernel)(const lmd::PanelGemm&, int), bool pairs>
void gemm(std::uintptr_t x, std::int64_t rows, std::int64_t k, std::int64_t x_stride,
          std::uintptr_t weights, int bits, std::uintptr_t scales, std::uintptr_t mins,
          std::int64_t group, std::int64_t n, std::uintptr_t y, std::int64_t y_stride,
          std::uintptr_t bias, int threads) {
  const lmd::PanelGemm args{reinterpret_cast<const float*>(x),
                            rows,
                            k,
                            x_stride,
                            reinterpret_cast<const void*>(weights),
                            bits,
                            reinterpret_cast<const float*>(scales),
                            reinterpret_cast<const float*>(mins),
                            group,
                            n,
                            reinterpret_cast<float*>(y),
                            y_stride,
                            reinterpret_cast<const float*>(bias)};
  if (pairs ? !lmd::pair_gemm_supported() : !lmd::cpu_kernels_supported()) {
    throw std::runtime_error(pairs ? "pair_gemm needs AVX-512 with BF16"
                                   : "panel_gemm needs AVX2 and FMA");
  }
  if (const char* wrong = wrong_args(args, pairs)) throw std::invalid_argument(wrong);
  py::gil_scoped_release release;
  kernel(args, threads);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() =
      "lmd native helpers: the KV transfer engine (host and cuda_ipc transports) and a "
      "CUDA probe";
  m.attr("ABI_VERSION") = 1;

  m.def(
      "probe_cuda",
      [] {
        lmd::CudaProbe probe;
        {
          py::gil_scoped_release release;  // cuInit can take a second on a GPU host
          probe = lmd::probe_cuda();
        }
        py::dict out;
        out["available"] = probe.available;
        out["devices"] = probe.devices;
        out["reason"] = probe.reason;
        return out;
      },
      "Load the CUDA driver at run time and count devices.\n\n"
      "Returns {'available': bool, 'devices': int, 'reason': str}; never raises.");

  m.def("cpu_kernels_supported", &lmd::cpu_kernels_supported,
        "Does this CPU run panel_gemm and paged_decode_attention (AVX2 and FMA)?");
  m.def("panel_gemm", &gemm<lmd::panel_gemm, false>,
      "y = x W^T (+ b) in float32 for a few rows (native/panel_gemm.h), on addresses:\n"
      "x [rows, k] (row stride x_stride), y [rows, n] (row stride y_stride), bias [n] or\n"
      "0; W by bits: 32, float panels [ceil(n/8), k, 8]; 8, uint8 codes [ceil(n/8), k, 8];\n"
      "4, uint32 [ceil(n/8), k] of eight 4-bit codes; with codes, scales and mins\n"
      "[ceil(n/8), k/group, 8] float32 (W = code * scale + min), else 0. `threads` of\n"
      "the loaded libgomp's team.");

  m.def("pair_gemm_supported", &lmd::pair_gemm_supported,
        "Does this CPU run pair_gemm (AVX-512 F, BW, DQ and BF16)?");
  m.def("pair_gemm", &gemm<lmd::pair_gemm, true>,
      "y = x W^T (+ b) for a few rows with x rounded to bf16 (native/pair_gemm.h), on\n"
      "addresses, as panel_gemm's but W: codes of 4 bits, [ceil(n/16), k/2, 16] bytes\n"
      "(inputs 2i, 2i+1 in a byte's low, high nibble), or of 8, [ceil(n/16), k/2, 16, 2];\n"
      "scales and mins [2 ceil(n/16), k/group, 8] float32.");

  m.def("panel_gemm_wide", &lmd::panel_gemm_wide, py::arg("enable") = -1,
        "Whether panel_gemm takes two panels a 512-bit vector (AVX-512F and DQ; bitwise\n"
        "the same product): enable 1 or 0 sets it (1 only where supported), -1 leaves it;\n"
        "returns the setting.");
  m.def(
      "paged_decode_attention",
      [](std::uintptr_t q, std::int64_t rows, std::int64_t heads_kv, std::int64_t groups,
         std::int64_t dim, std::uintptr_t kv, std::int64_t num_blocks, std::int64_t num_layers,
         std::int64_t block_size, std::int64_t layer, std::uintptr_t tables,
         std::int64_t table_width, std::uintptr_t positions, std::int64_t window, float scale,
         std::uintptr_t out, int threads) {
        if (!lmd::cpu_kernels_supported()) {
          throw std::runtime_error("paged_decode_attention needs AVX2 and FMA");
        }
        lmd::PagedDecode args{reinterpret_cast<const float*>(q),
                              rows,
                              heads_kv,
                              groups,
                              dim,
                              reinterpret_cast<const float*>(kv),
                              num_blocks,
                              num_layers,
                              block_size,
                              layer,
                              reinterpret_cast<const std::int64_t*>(tables),
                              table_width,
                              reinterpret_cast<const std::int64_t*>(positions),
                              window,
                              scale,
                              reinterpret_cast<float*>(out)};
        lmd::check_paged_decode(args);
        py::gil_scoped_release release;
        lmd::paged_decode_attention(args, threads);
      },
      "Decode attention over the paged KV pool in place (native/paged_attention.h), on\n"
      "addresses: q and out [rows, heads_kv, groups, dim], the pool [num_blocks,\n"
      "num_layers, 2, block_size, heads_kv, dim], tables [rows, table_width] and\n"
      "positions [rows] int64; window 0 for none. float32, contiguous.");

  m.def(
      "w4a16_rows_ready",
      [](int device) {
        py::gil_scoped_release release;  // the driver compiles the PTX on first use
        return lmd::w4a16_rows_ready(device);
      },
      py::arg("device"),
      "Load the W4A16 decode kernels on CUDA device `device` (once); returns \"\" when\n"
      "they are loaded, else why not. Never raises.");
  m.def(
      "w4a16_rows",
      [](int device, std::uintptr_t x, std::uintptr_t q, std::uintptr_t s, std::uintptr_t z,
         std::uintptr_t bias, std::uintptr_t y, int rows, int n, int k, int x_stride, bool bf16,
         int warps, std::uintptr_t stream, bool gated) {
        lmd::W4a16RowsArgs args{x, q, s, z, bias, y, rows, n, k, x_stride};
        args.gated = gated ? 1 : 0;
        lmd::launch_w4a16_rows(device, args, bf16, warps, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("q"), py::arg("s"), py::arg("z"),
      py::arg("bias"), py::arg("y"), py::arg("rows"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("bf16"), py::arg("warps"), py::arg("stream"),
      py::arg("gated") = false,
      "y = x W^T (+ b) for 1-16 rows of x on the tensor cores (native/kernels/w4a16_rows.cu),\n"
      "enqueued on `stream` (a CUstream of device `device`), on addresses: x [rows, k]\n"
      "(row stride x_stride) and y [rows, n] in bf16 (or fp16), qweight [k / 8, n] int32,\n"
      "scales [k / 128, n] in x's dtype, zeros [k / 128, n] uint8, bias [n] or 0; n / 32\n"
      "CTAs of `warps` warps (1-16 up to 8 rows, 1-8 above) splitting K. `gated`: W is\n"
      "gate | up (n a multiple of 64, no bias) and y [rows, n / 2] silu(gate) * up.\n"
      "ValueError for bad arguments, RuntimeError when the kernels are not loaded or the\n"
      "launch fails.");
  m.def(
      "w4a16_rows_normed",
      [](int device, std::uintptr_t x, std::uintptr_t residual, std::uintptr_t gamma,
         std::uintptr_t summed, float eps, std::uintptr_t q, std::uintptr_t s, std::uintptr_t z,
         std::uintptr_t bias, std::uintptr_t y, int n, int k, bool bf16, int warps,
         std::uintptr_t stream, bool gated) {
        const lmd::W4a16RowsArgs args{x, q, s, z, bias, y, 1, n, k, k,
                                      residual, gamma, summed, eps, gated ? 1 : 0};
        lmd::launch_w4a16_rows_normed(device, args, bf16, warps, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("residual"), py::arg("gamma"), py::arg("summed"),
      py::arg("eps"), py::arg("q"), py::arg("s"), py::arg("z"), py::arg("bias"), py::arg("y"),
      py::arg("n"), py::arg("k"), py::arg("bf16"), py::arg("warps"), py::arg("stream"),
      py::arg("gated") = false,
      "w4a16_rows for one row of RMSNorm(x + residual) with weight gamma [k] (residual 0:\n"
      "RMSNorm(x)), made in the launch; summed [k] (or 0) receives x + residual, and is\n"
      "neither x nor residual. x, residual, gamma and summed 16-byte aligned, k at most\n"
      "16384 and 1,024 a warp. Raises as w4a16_rows.");
  m.def(
      "w4a16_wide",
      [](int device, std::uintptr_t x, std::uintptr_t q, std::uintptr_t s, std::uintptr_t z,
         std::uintptr_t bias, std::uintptr_t y, std::uintptr_t work, std::uintptr_t counters,
         int rows, int n, int k, int x_stride, int splits, bool bf16, std::uintptr_t stream) {
        const lmd::W4a16WideArgs args{x, q, s, z, bias, y, work, counters,
                                      rows, n, k, x_stride, splits};
        lmd::launch_w4a16_wide(device, args, bf16, stream);
      },
      "y = x W^T (+ b) for up to 32 rows of x on the tensor cores\n"
      "(native/kernels/w4a16_wide.cu), addresses as w4a16_rows' (x 16-byte aligned, its row\n"
      "stride a multiple of 8): ceil(n / 128) x splits CTAs. With splits > 1 (at most\n"
      "k / 128), work is [splits, rows, n] float32 and counters ceil(n / 128) uint32 zeros,\n"
      "zero again when the launch is done; launches sharing counters go on one stream.\n"
      "ValueError for bad arguments, RuntimeError as w4a16_rows.");

  m.def(
      "w4a16_experts",
      [](int device, std::uintptr_t x, std::uintptr_t q, std::uintptr_t s, std::uintptr_t z,
         std::uintptr_t pairs, std::uintptr_t experts, std::uintptr_t weights, std::uintptr_t y,
         int rows, int blocks, int num_pairs, int row_div, int n, int k, int x_stride,
         bool bf16, int warps, std::uintptr_t stream, bool gated, bool mixed) {
        const lmd::W4a16ExpertsArgs args{x, q, s, z, pairs, experts, weights, y, n, k,
                                         x_stride, num_pairs, row_div, gated ? 1 : 0,
                                         mixed ? 1 : 0};
        lmd::launch_w4a16_experts(device, args, rows, blocks, bf16, warps, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("q"), py::arg("s"), py::arg("z"),
      py::arg("pairs"), py::arg("experts"), py::arg("weights"), py::arg("y"), py::arg("rows"),
      py::arg("blocks"), py::arg("num_pairs"), py::arg("row_div"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("bf16"), py::arg("warps"), py::arg("stream"),
      py::arg("gated") = false, py::arg("mixed") = false,
      "y[p] = x[p / row_div] W_e^T (* weights[p]) for each pair p of `blocks` blocks of\n"
      "`rows` (8 or 16) pairs sorted by expert (native/kernels/w4a16_experts.cu), e the\n"
      "block's expert, on addresses: pairs [blocks * rows] int32 (num_pairs: padding; 0:\n"
      "block b holds pair b alone, blocks == num_pairs),\n"
      "experts [blocks] int32 (-1: none), x (row stride x_stride) and y [num_pairs, n] in\n"
      "bf16 (or fp16), qweight [E, k / 8, n] int32, scales [E, k / 128, n] in x's dtype,\n"
      "zeros [E, k / 128, n] uint8, weights [num_pairs] float32 or 0; n / 32 x blocks\n"
      "CTAs of `warps` warps (1-16 for 8 rows, 1-8 for 16) splitting K; rows 64 (Hopper:\n"
      "w4a16_wgmma.cu's experts entry, ceil(n / 256) x blocks CTAs; warps 0, sorted pairs,\n"
      "x, scales and zeros 16-byte aligned, x_stride a multiple of 8). gated: W_e is\n"
      "gate | up and y [num_pairs, n / 2] = silu(x gate^T) * (x up^T) (no weights, n a\n"
      "multiple of 64). mixed: one token's pairs (8 rows, pairs 0, weights, blocks 1, at\n"
      "most 16 pairs), n / 16 CTAs of ceil(num_pairs / 2) x `warps` warps, and y [1, n]\n"
      "the sum over p of weights[p] x[p / row_div] W_e^T, each term rounded to x's dtype\n"
      "first.\n"
      "ValueError for bad arguments, RuntimeError as w4a16_rows.");

  m.def(
      "w4a16_wgmma_ready",
      [](int device) {
        py::gil_scoped_release release;
        return lmd::w4a16_wgmma_ready(device);
      },
      py::arg("device"),
      "Load the W4A16 wgmma kernel for 33-64 rows on CUDA device `device` (once; it needs\n"
      "a GPU of compute capability 9.0); returns \"\" when it is loaded, else why not.\n"
      "Never raises.");
  m.def(
      "w4a16_wgmma",
      [](int device, std::uintptr_t x, std::uintptr_t q, std::uintptr_t s, std::uintptr_t z,
         std::uintptr_t bias, std::uintptr_t y, std::uintptr_t work, std::uintptr_t counters,
         int rows, int n, int k, int x_stride, int splits, bool bf16, std::uintptr_t stream,
         bool gated) {
        const lmd::W4a16WideArgs args{x, q, s, z, bias, y, work, counters,
                                      rows, n, k, x_stride, splits, gated ? 1 : 0};
        lmd::launch_w4a16_wgmma(device, args, bf16, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("q"), py::arg("s"), py::arg("z"), py::arg("bias"),
      py::arg("y"), py::arg("work"), py::arg("counters"), py::arg("rows"), py::arg("n"),
      py::arg("k"), py::arg("x_stride"), py::arg("splits"), py::arg("bf16"), py::arg("stream"),
      py::arg("gated") = false,
      "y = x W^T (+ b) for up to 64 rows of x on Hopper's tensor cores\n"
      "(native/kernels/w4a16_wgmma.cu), arguments as w4a16_wide's (scales, zeros 16-byte\n"
      "aligned): ceil(n / 256) x splits CTAs. With splits > 1 (at most 8, and at most\n"
      "w4a16_wgmma_ctas CTAs in all: they wait for each other), work is [ceil(n / 256) *\n"
      "splits, 64, 256] float32 (each CTA's sums) and counters ceil(n / 256) uint64\n"
      "multiples of 840 (zeros at first: each launch adds 840 to a span's; never reset);\n"
      "else both 0. gated: W is gate | up and y [rows, n / 2] = silu(x gate^T) * (x up^T)\n"
      "(one split, no bias, n a multiple of 64).\n"
      "ValueError for bad arguments, RuntimeError as w4a16_rows.");
  m.def("w4a16_wgmma_ctas", &lmd::w4a16_wgmma_ctas, py::arg("device"),
        "How many CTAs of the wgmma kernel CUDA device `device` runs at once (a launch\n"
        "with splits > 1 takes at most that many); RuntimeError when the kernel is not\n"
        "ready.");

  m.def(
      "fp8_rows_ready",
      [](int device) {
        py::gil_scoped_release release;  // the driver compiles the PTX on first use
        return lmd::fp8_rows_ready(device);
      },
      py::arg("device"),
      "Load the FP8 decode kernels on CUDA device `device` (once; they need sm_89 or\n"
      "newer); returns \"\" when they are loaded, else why not. Never raises.");
  m.def(
      "fp8_rows",
      [](int device, std::uintptr_t x, std::uintptr_t w, std::uintptr_t s, std::uintptr_t bias,
         std::uintptr_t y, int rows, int n, int k, int x_stride, int s_stride, bool bf16,
         int warps, std::uintptr_t stream) {
        const lmd::Fp8RowsArgs args{x, w, s, bias, y, rows, n, k, x_stride, s_stride, 0};
        lmd::launch_fp8_rows(device, args, bf16, warps, stream);
      },
      "y = x W^T (+ b) for 1-16 rows of x on the tensor cores (native/kernels/fp8_rows.cu),\n"
      "enqueued on `stream` (a CUstream of device `device`), on addresses: x [rows, k]\n"
      "(16-byte aligned, row stride x_stride a multiple of 8) and y [rows, n] in bf16 (or\n"
      "fp16), W [n, k] e4m3, scales float32 [n] (s_stride 0) or [ceil(n / 128), k / 128]\n"
      "at row stride s_stride, bias [n] or 0; n / 32 CTAs of `warps` warps (1-16 up to 8\n"
      "rows, 1-8 above) splitting K. ValueError for bad arguments, RuntimeError when the\n"
      "kernels are not loaded or the launch fails.");

  lmd::bind_transport(m);
}
