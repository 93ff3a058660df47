#include "decode_rows.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>

#include "cuda_device.h"
#include "cuda_driver.h"

namespace lmd {
namespace {

// The kernels of each module: {fp16, bf16} x {fewer, more rows} (wgmma: {dense, experts}).
constexpr const char* kNames[2][2] = {{"lmd_w4a16_rows_f16_m8", "lmd_w4a16_rows_f16_m16"},
                                       {"lmd_w4a16_rows_bf16_m8", "lmd_w4a16_rows_bf16_m16"}};
constexpr const char* kNormedNames[2] = {"lmd_w4a16_rows_normed_f16_m1",
                                         "lmd_w4a16_rows_normed_bf16_m1"};
constexpr const char* kExpertsNames[2][2] = {
    {"lmd_w4a16_experts_f16_m8", "lmd_w4a16_experts_f16_m16"},
    {"lmd_w4a16_experts_bf16_m8", "lmd_w4a16_experts_bf16_m16"}};
constexpr const char* kWideNames[2] = {"lmd_w4a16_wide_f16_m32", "lmd_w4a16_wide_bf16_m32"};
constexpr const char* kWgmmaNames[2][2] = {
    {"lmd_w4a16_wgmma_f16_m64", "lmd_w4a16_wgmma_experts_f16_m64"},
    {"lmd_w4a16_wgmma_bf16_m64", "lmd_w4a16_wgmma_experts_bf16_m64"}};
constexpr const char* kFp8Names[2][2] = {{"lmd_fp8_rows_f16_m8", "lmd_fp8_rows_f16_m16"},
                                          {"lmd_fp8_rows_bf16_m8", "lmd_fp8_rows_bf16_m16"}};

struct Loaded {
  cu::Context context = nullptr;  // the primary context, retained for the process
  cu::Module module = nullptr;
  cu::Module wide_module = nullptr;
  cu::Function kernels[2][2] = {};
  cu::Function normed[2] = {};
  cu::Function wide[2] = {};
  cu::Module experts_module = nullptr;
  cu::Function experts[2][2] = {};
  std::string error;  // why not loaded; "" when loaded
  cu::Module fp8_module = nullptr;  // loaded apart: it needs sm_89 where W4A16 needs sm_80
  cu::Function fp8[2][2] = {};
  std::string fp8_error;
  cu::Module wgmma_module = nullptr;  // apart: only sm_90 runs its sm_90a PTX
  cu::Function wgmma[2] = {};          // dense
  cu::Function wgmma_experts[2] = {};  // a block of 64 sorted pairs
  std::string wgmma_error;
  int wgmma_ctas = 0;  // w4a16_wgmma_ctas
};

// The four kernels {fp16, bf16} x {two kinds} named `names` of `module`.
void get_functions(const CudaDriver& d, cu::Module module, const char* const (&names)[2][2],
                   cu::Function (&out)[2][2]) {
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    for (int more = 0; more < 2; ++more) {
      d.check(d.cuModuleGetFunction(&out[bf16][more], module, names[bf16][more]),
              names[bf16][more]);
    }
  }
}

// The wgmma kernels into `out` (the context current), or why not in out.wgmma_error.
void load_wgmma(const CudaDriver& d, cu::Device device, Loaded& out) {
  try {
    int major = 0;
    d.check(d.cuDeviceGetAttribute(&major, cu::kDeviceAttributeComputeCapabilityMajor, device),
            "cuDeviceGetAttribute");
    if (major != 9) {
      out.wgmma_error = "w4a16_wgmma needs a GPU of compute capability 9.0 (sm_90a), not " +
                        std::to_string(major) + ".x";
      return;
    }
    d.check(d.cuModuleLoadData(&out.wgmma_module, kW4a16WgmmaPtx), "cuModuleLoadData(w4a16_wgmma)");
    cu::Function functions[2][2];  // {fp16, bf16} x {dense, experts}
    get_functions(d, out.wgmma_module, kWgmmaNames, functions);
    for (int bf16 = 0; bf16 < 2; ++bf16) {
      for (int experts = 0; experts < 2; ++experts) {
        (experts ? out.wgmma_experts : out.wgmma)[bf16] = functions[bf16][experts];
        d.check(d.cuFuncSetAttribute(functions[bf16][experts],
                                     cu::kFuncAttributeMaxDynamicSharedSizeBytes,
                                     kW4a16WgmmaSharedBytes),
                "cuFuncSetAttribute(w4a16_wgmma)");
      }
    }
    int per_sm = 0, sms = 0;
    d.check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, out.wgmma[1],
                                                          kW4a16WgmmaThreads,
                                                          kW4a16WgmmaSharedBytes),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor(w4a16_wgmma)");
    d.check(d.cuDeviceGetAttribute(&sms, cu::kDeviceAttributeMultiprocessorCount, device),
            "cuDeviceGetAttribute");
    out.wgmma_ctas = per_sm * sms;
  } catch (const std::exception& e) {
    out.wgmma_error = e.what();
  }
}

std::mutex mu;
std::map<int, Loaded> loaded;  // by device ordinal; entries are never removed

Loaded load(int ordinal) {
  Loaded out;
  try {
    const CudaDriver& d = cuda_driver();
    cu::Device device = 0;
    d.check(d.cuDeviceGet(&device, ordinal), "cuDeviceGet");
    d.check(d.cuDevicePrimaryCtxRetain(&out.context, device), "cuDevicePrimaryCtxRetain");
    ScopedContext scope(d, out.context);
    d.check(d.cuModuleLoadData(&out.module, kW4a16RowsPtx), "cuModuleLoadData(w4a16_rows)");
    d.check(d.cuModuleLoadData(&out.wide_module, kW4a16WidePtx), "cuModuleLoadData(w4a16_wide)");
    d.check(d.cuModuleLoadData(&out.experts_module, kW4a16ExpertsPtx),
            "cuModuleLoadData(w4a16_experts)");
    get_functions(d, out.module, kNames, out.kernels);
    get_functions(d, out.experts_module, kExpertsNames, out.experts);
    for (int bf16 = 0; bf16 < 2; ++bf16) {
      d.check(d.cuModuleGetFunction(&out.wide[bf16], out.wide_module, kWideNames[bf16]),
              kWideNames[bf16]);
      d.check(d.cuModuleGetFunction(&out.normed[bf16], out.module, kNormedNames[bf16]),
              kNormedNames[bf16]);
    }
    load_wgmma(d, device, out);
  } catch (const std::exception& e) {
    out.error = e.what();
    out.fp8_error = out.error;
    out.wgmma_error = out.error;
    return out;
  }
  try {
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(d, out.context);
    d.check(d.cuModuleLoadData(&out.fp8_module, kFp8RowsPtx), "cuModuleLoadData(fp8_rows)");
    get_functions(d, out.fp8_module, kFp8Names, out.fp8);
  } catch (const std::exception& e) {
    out.fp8_error = e.what();
  }
  return out;
}

const Loaded& loaded_on(int ordinal) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = loaded.find(ordinal);
  if (it == loaded.end()) it = loaded.emplace(ordinal, load(ordinal)).first;
  return it->second;
}

enum class Kernels { kW4a16, kFp8, kWgmma };

const Loaded& loaded_or_throw(int ordinal, Kernels which = Kernels::kW4a16) {
  const Loaded& l = loaded_on(ordinal);
  const std::string& error = which == Kernels::kFp8     ? l.fp8_error
                             : which == Kernels::kWgmma ? l.wgmma_error
                                                        : l.error;
  if (!error.empty()) throw std::runtime_error(error);
  return l;
}

// Enqueues `kernel` with `args` as its one parameter on `stream`, in the primary context;
// `cooperative`: all its CTAs resident at once, or the driver refuses the launch.
template <typename Args>
void launch(const Loaded& l, cu::Function kernel, const Args& args, unsigned grid_x,
            unsigned grid_y, unsigned threads, unsigned shared_bytes, std::uintptr_t stream,
            const char* what, bool cooperative = false) {
  const CudaDriver& d = cuda_driver();
  Args copy = args;
  void* params[] = {&copy};
  ScopedContext scope(d, l.context);
  if (!cooperative) {
    d.check(d.cuLaunchKernel(kernel, grid_x, grid_y, 1, threads, 1, 1, shared_bytes,
                             reinterpret_cast<cu::Stream>(stream), params, nullptr),
            what);
    return;
  }
  cu::LaunchAttribute attribute = {};
  attribute.id = cu::kLaunchAttributeCooperative;
  attribute.value.cooperative = 1;
  const cu::LaunchConfig config{{grid_x, grid_y, 1}, {threads, 1, 1}, shared_bytes,
                                reinterpret_cast<cu::Stream>(stream), &attribute, 1};
  d.check(d.cuLaunchKernelEx(&config, kernel, params, nullptr), what);
}

// Enqueues one of a rows kernel's four entries ({fp16, bf16} x {up to 8, up to 16 rows}):
// N / 32 CTAs of `warps` warps, with room for their warps' sums in shared memory.
template <typename Args>
void launch_rows(const Loaded& l, const cu::Function (&kernels)[2][2], const Args& args,
                 bool bf16, int warps, std::uintptr_t stream, const char* what) {
  const int tiles = args.m > 8 ? 2 : 1;
  const unsigned sums = static_cast<unsigned>(warps) * tiles * 8 * 32 * sizeof(float);
  launch(l, kernels[bf16 ? 1 : 0][tiles - 1], args,
         static_cast<unsigned>(args.n / kW4a16RowsColumns), 1,
         static_cast<unsigned>(warps) * 32, sums, stream, what);
}

}  // namespace

std::string w4a16_rows_ready(int ordinal) {
  if (ordinal < 0) return "w4a16_rows: no such CUDA device " + std::to_string(ordinal);
  return loaded_on(ordinal).error;
}

void launch_w4a16_rows(int ordinal, const W4a16RowsArgs& args, bool bf16, int warps,
                       std::uintptr_t stream) {
  const std::string wrong = w4a16_rows_check(args, warps);
  if (!wrong.empty()) throw std::invalid_argument(wrong);
  const Loaded& l = loaded_or_throw(ordinal);
  launch_rows(l, l.kernels, args, bf16, warps, stream, "cuLaunchKernel(w4a16_rows)");
}

void launch_w4a16_rows_normed(int ordinal, const W4a16RowsArgs& args, bool bf16, int warps,
                              std::uintptr_t stream) {
  const std::string wrong = w4a16_rows_normed_check(args, warps);
  if (!wrong.empty()) throw std::invalid_argument(wrong);
  const Loaded& l = loaded_or_throw(ordinal);
  // The warps' sums (one x tile), then x's row in 16 bits.
  const unsigned shared = static_cast<unsigned>(warps * 8 * 32 * sizeof(float) + args.k * 2);
  launch(l, l.normed[bf16 ? 1 : 0], args, static_cast<unsigned>(args.n / kW4a16RowsColumns), 1,
         static_cast<unsigned>(warps) * 32, shared, stream, "cuLaunchKernel(w4a16_rows_normed)");
}

void launch_w4a16_experts(int ordinal, const W4a16ExpertsArgs& args, int rows, int blocks,
                          bool bf16, int warps, std::uintptr_t stream) {
  const std::string wrong = w4a16_experts_check(args, rows, blocks, warps);
  if (!wrong.empty()) throw std::invalid_argument(wrong);
  const bool wgmma = rows == kW4a16WgmmaMaxRows;
  const Loaded& l = loaded_or_throw(ordinal, wgmma ? Kernels::kWgmma : Kernels::kW4a16);
  const int columns = wgmma ? kW4a16WgmmaColumns : kW4a16RowsColumns / (args.mixed ? 2 : 1);
  const int threads = wgmma ? kW4a16WgmmaThreads : experts_warps(args, warps) * 32;
  const int shared = wgmma ? kW4a16WgmmaSharedBytes : threads * rows * 4;  // the warps' sums
  launch(l, wgmma ? l.wgmma_experts[bf16 ? 1 : 0] : l.experts[bf16 ? 1 : 0][rows / 16], args,
         (args.n + columns - 1) / columns, blocks, threads, shared, stream,
         "cuLaunchKernel(w4a16_experts)");
}

namespace {

// What a kernel that splits K over CTAs (w4a16_wide, w4a16_wgmma) takes: its name (its
// messages' prefix) and its launch's, the most rows, a CTA's columns, threads and
// dynamic shared memory, the alignments (bytes) its loads and stores ask of scales,
// zeros, y, bias and counters (x and the words are copied 16 bytes at a time by both), how its
// splits' sums in work (16-byte aligned) are added (counted in counters: by the last CTA
// of a span; or, with `resident`, by all of a span's CTAs, each a share once all have
// arrived, so at most kW4a16WgmmaMaxSplits and a cooperative launch of at most
// Loaded::*resident CTAs), and where Loaded keeps it.
struct SplitKernel {
  const char* name;
  const char* launch;
  int max_rows, columns, threads, shared_bytes;
  int s_align, z_align, y_align, bias_align, counters_align;
  int Loaded::*resident;  // the CTAs the device holds at once; null: not cooperative
  Kernels module;
  cu::Function (Loaded::*functions)[2];
};

// w4a16_wide: 8-byte scale, bias and y loads and stores, 4-byte zeros, 32-bit counters.
constexpr SplitKernel kWide{"w4a16_wide", "cuLaunchKernel(w4a16_wide)",
                            kW4a16WideMaxRows, kW4a16WideColumns, kW4a16WideThreads, 0,
                            8, 4, 8, 8, 4, nullptr, Kernels::kW4a16, &Loaded::wide};
// w4a16_wgmma: scales and zeros copied 16 bytes at a time, 8-byte y stores, 2-byte bias
// loads, 64-bit counters.
constexpr SplitKernel kWgmma{"w4a16_wgmma", "cuLaunchKernelEx(w4a16_wgmma)",
                             kW4a16WgmmaMaxRows, kW4a16WgmmaColumns, kW4a16WgmmaThreads,
                             kW4a16WgmmaSharedBytes, 16, 16, 8, 2, 8, &Loaded::wgmma_ctas,
                             Kernels::kWgmma, &Loaded::wgmma};

std::string split_check(const SplitKernel& kernel, const W4a16WideArgs& a) {
  const std::string name = kernel.name;
  if (a.m < 1 || a.m > kernel.max_rows || a.n < 1 || a.n % kW4a16RowsColumns || a.k < 128 ||
      a.k % 128 || a.x_stride < a.k) {
    return name + ": m must be 1.." + std::to_string(kernel.max_rows) +
           ", n a multiple of 32, k of 128 and x_stride >= k";
  }
  const int max_splits =
      kernel.resident ? std::min(a.k / 128, kW4a16WgmmaMaxSplits) : a.k / 128;
  if (a.splits < 1 || a.splits > max_splits) {
    const std::string most =
        kernel.resident ? ", at most " + std::to_string(kW4a16WgmmaMaxSplits) + ")" : ")";
    return name + ": splits must be 1.." + std::to_string(max_splits) + " (k / 128" + most;
  }
  if (!a.x || !a.q || !a.s || !a.z || !a.y || a.x % 16 || a.x_stride % 8 || a.q % 16 ||
      a.s % kernel.s_align || a.z % kernel.z_align || a.y % kernel.y_align ||
      a.bias % kernel.bias_align ||
      (a.splits > 1 && (!a.work || a.work % 16 || !a.counters ||
                          a.counters % kernel.counters_align))) {
    return name + ": a null or misaligned address";
  }
  if (a.gated && (!kernel.resident || a.splits != 1 || a.bias || a.n % 64)) {
    return name + ": gated takes the wgmma kernel, one split, no bias and n a multiple of 64";
  }
  return "";
}

// Enqueues `kernel` for `args`: ceil(N / its columns) x splits CTAs.
void launch_split(const SplitKernel& kernel, int ordinal, const W4a16WideArgs& args, bool bf16,
                  std::uintptr_t stream) {
  const std::string wrong = split_check(kernel, args);
  if (!wrong.empty()) throw std::invalid_argument(wrong);
  const Loaded& l = loaded_or_throw(ordinal, kernel.module);
  const int spans = (args.n + kernel.columns - 1) / kernel.columns;
  const bool cooperative = kernel.resident && args.splits > 1;
  if (cooperative && spans * args.splits > l.*kernel.resident) {
    throw std::invalid_argument(std::string(kernel.name) + ": " + std::to_string(spans) +
                                " spans x " + std::to_string(args.splits) +
                                " splits are more CTAs than the device runs at once (" +
                                std::to_string(l.*kernel.resident) + ")");
  }
  launch(l, (l.*kernel.functions)[bf16 ? 1 : 0], args, static_cast<unsigned>(spans),
         static_cast<unsigned>(args.splits), static_cast<unsigned>(kernel.threads),
         static_cast<unsigned>(kernel.shared_bytes), stream, kernel.launch, cooperative);
}

}  // namespace

std::string w4a16_wide_check(const W4a16WideArgs& a) { return split_check(kWide, a); }

void launch_w4a16_wide(int ordinal, const W4a16WideArgs& args, bool bf16, std::uintptr_t stream) {
  launch_split(kWide, ordinal, args, bf16, stream);
}

std::string w4a16_wgmma_ready(int ordinal) {
  if (ordinal < 0) return "w4a16_wgmma: no such CUDA device " + std::to_string(ordinal);
  return loaded_on(ordinal).wgmma_error;
}

std::string w4a16_wgmma_check(const W4a16WideArgs& a) { return split_check(kWgmma, a); }

int w4a16_wgmma_ctas(int ordinal) { return loaded_or_throw(ordinal, Kernels::kWgmma).wgmma_ctas; }

void launch_w4a16_wgmma(int ordinal, const W4a16WideArgs& args, bool bf16,
                        std::uintptr_t stream) {
  launch_split(kWgmma, ordinal, args, bf16, stream);
}

std::string fp8_rows_ready(int ordinal) {
  if (ordinal < 0) return "fp8_rows: no such CUDA device " + std::to_string(ordinal);
  return loaded_on(ordinal).fp8_error;
}

void launch_fp8_rows(int ordinal, const Fp8RowsArgs& args, bool bf16, int warps,
                     std::uintptr_t stream) {
  const std::string wrong = fp8_rows_check(args, warps);
  if (!wrong.empty()) throw std::invalid_argument(wrong);
  const Loaded& l = loaded_or_throw(ordinal, Kernels::kFp8);
  launch_rows(l, l.fp8, args, bf16, warps, stream, "cuLaunchKernel(fp8_rows)");
}

}  // namespace lmd
