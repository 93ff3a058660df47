#include "cuda_driver.h"

#include <dlfcn.h>

#include <initializer_list>
#include <mutex>
#include <stdexcept>

namespace lmd {
namespace {

struct Loaded {
  CudaDriver driver;
  CudaProbe probe;
  bool complete = false;  // every entry point of CudaDriver resolved
  std::string missing;    // the first entry point that did not resolve
};

// Resolves the first of `names` the library exports into `fn`.
template <typename Fn>
bool resolve(void* lib, Fn& fn, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (void* sym = dlsym(lib, name)) {
      fn = reinterpret_cast<Fn>(sym);
      return true;
    }
  }
  return false;
}

bool resolve_all(void* lib, CudaDriver& d, std::string& missing) {
  // Where cuda.h maps a name to a `_v2` symbol, only the `_v2` one is asked for when the
  // unversioned one has another signature (cuMemGetAddressRange, cuCtx*Current).
#define LMD_RESOLVE(field, ...)                      \
  if (!resolve(lib, d.field, {__VA_ARGS__})) {       \
    missing = #field;                                \
    return false;                                    \
  }
  LMD_RESOLVE(cuDeviceGet, "cuDeviceGet")
  LMD_RESOLVE(cuGetErrorName, "cuGetErrorName")
  LMD_RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
  LMD_RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2",
              "cuDevicePrimaryCtxRelease")
  LMD_RESOLVE(cuCtxPushCurrent, "cuCtxPushCurrent_v2")
  LMD_RESOLVE(cuCtxPopCurrent, "cuCtxPopCurrent_v2")
  LMD_RESOLVE(cuStreamCreate, "cuStreamCreate")
  LMD_RESOLVE(cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy")
  LMD_RESOLVE(cuStreamSynchronize, "cuStreamSynchronize")
  LMD_RESOLVE(cuStreamWaitEvent, "cuStreamWaitEvent")
  LMD_RESOLVE(cuEventCreate, "cuEventCreate")
  LMD_RESOLVE(cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy")
  LMD_RESOLVE(cuEventRecord, "cuEventRecord")
  LMD_RESOLVE(cuEventQuery, "cuEventQuery")
  LMD_RESOLVE(cuMemcpyAsync, "cuMemcpyAsync")
  LMD_RESOLVE(cuMemGetAddressRange, "cuMemGetAddressRange_v2")
  LMD_RESOLVE(cuPointerGetAttribute, "cuPointerGetAttribute")
  LMD_RESOLVE(cuIpcGetMemHandle, "cuIpcGetMemHandle")
  LMD_RESOLVE(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
  LMD_RESOLVE(cuIpcCloseMemHandle, "cuIpcCloseMemHandle")
  LMD_RESOLVE(cuModuleLoadData, "cuModuleLoadData")
  LMD_RESOLVE(cuModuleUnload, "cuModuleUnload")
  LMD_RESOLVE(cuModuleGetFunction, "cuModuleGetFunction")
  LMD_RESOLVE(cuLaunchKernel, "cuLaunchKernel")
  LMD_RESOLVE(cuFuncSetAttribute, "cuFuncSetAttribute")
  LMD_RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute")
  LMD_RESOLVE(cuLaunchKernelEx, "cuLaunchKernelEx")
  LMD_RESOLVE(cuOccupancyMaxActiveBlocksPerMultiprocessor,
              "cuOccupancyMaxActiveBlocksPerMultiprocessor")
#undef LMD_RESOLVE
  return true;
}

Loaded load_once() {
  Loaded out;
  CudaProbe& probe = out.probe;
  // The handle stays open for the life of the process: the transports call into it.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    probe.reason = std::string("libcuda.so.1 not loadable: ") + (err ? err : "unknown error");
    return out;
  }
  CudaDriver& d = out.driver;
  resolve(lib, d.cuGetErrorString, {"cuGetErrorString"});
  if (!resolve(lib, d.cuInit, {"cuInit"}) ||
      !resolve(lib, d.cuDeviceGetCount, {"cuDeviceGetCount"})) {
    probe.reason = "libcuda.so.1 lacks cuInit or cuDeviceGetCount";
    return out;
  }
  if (cu::Result rc = d.cuInit(0); rc != cu::kSuccess) {
    probe.reason = d.error(rc, "cuInit");
    return out;
  }
  int n = 0;
  if (cu::Result rc = d.cuDeviceGetCount(&n); rc != cu::kSuccess) {
    probe.reason = d.error(rc, "cuDeviceGetCount");
    return out;
  }
  probe.available = n > 0;
  probe.devices = n;
  if (n == 0) probe.reason = "the CUDA driver reports no devices";
  out.complete = resolve_all(lib, d, out.missing);
  return out;
}

const Loaded& loaded() {
  static std::once_flag once;
  static Loaded result;
  std::call_once(once, [] { result = load_once(); });
  return result;
}

}  // namespace

std::string CudaDriver::error(cu::Result rc, const char* call) const {
  std::string msg = std::string(call) + " failed with CUDA error " + std::to_string(rc);
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName != nullptr && cuGetErrorName(rc, &name) == cu::kSuccess && name) {
    msg += std::string(" ") + name;
  }
  if (cuGetErrorString != nullptr && cuGetErrorString(rc, &text) == cu::kSuccess && text) {
    msg += std::string(" (") + text + ")";
  }
  return msg;
}

void CudaDriver::check(cu::Result rc, const char* call) const {
  if (rc != cu::kSuccess) throw std::runtime_error(error(rc, call));
}

CudaProbe probe_cuda() { return loaded().probe; }

const CudaDriver& cuda_driver() {
  const Loaded& l = loaded();
  if (!l.probe.available) {
    throw std::runtime_error("CUDA is not available: " + l.probe.reason);
  }
  if (!l.complete) {
    throw std::runtime_error("the CUDA driver is too old: libcuda.so.1 lacks " + l.missing +
                             "; update the NVIDIA driver");
  }
  return l.driver;
}

}  // namespace lmd
