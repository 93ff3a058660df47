#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace lmd {
namespace {

using CUresult = int;  // CUDA_SUCCESS == 0
using cuInit_t = CUresult (*)(unsigned int);
using cuDeviceGetCount_t = CUresult (*)(int*);
using cuGetErrorString_t = CUresult (*)(CUresult, const char**);

std::string driver_error(void* lib, CUresult rc, const char* call) {
  std::string msg = std::string(call) + " failed with CUDA error " + std::to_string(rc);
  auto get_string = reinterpret_cast<cuGetErrorString_t>(dlsym(lib, "cuGetErrorString"));
  const char* text = nullptr;
  if (get_string != nullptr && get_string(rc, &text) == 0 && text != nullptr) {
    msg += std::string(" (") + text + ")";
  }
  return msg;
}

CudaProbe probe_once() {
  CudaProbe probe;
  // The handle stays open for the life of the process: later transports use it.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    probe.reason = std::string("libcuda.so.1 not loadable: ") + (err ? err : "unknown error");
    return probe;
  }
  auto init = reinterpret_cast<cuInit_t>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<cuDeviceGetCount_t>(dlsym(lib, "cuDeviceGetCount"));
  if (init == nullptr || count == nullptr) {
    probe.reason = "libcuda.so.1 lacks cuInit or cuDeviceGetCount";
    return probe;
  }
  if (CUresult rc = init(0); rc != 0) {
    probe.reason = driver_error(lib, rc, "cuInit");
    return probe;
  }
  int n = 0;
  if (CUresult rc = count(&n); rc != 0) {
    probe.reason = driver_error(lib, rc, "cuDeviceGetCount");
    return probe;
  }
  probe.available = n > 0;
  probe.devices = n;
  if (n == 0) probe.reason = "the CUDA driver reports no devices";
  return probe;
}

}  // namespace

CudaProbe probe_cuda() {
  static std::once_flag once;
  static CudaProbe result;
  std::call_once(once, [] { result = probe_once(); });
  return result;
}

}  // namespace lmd
