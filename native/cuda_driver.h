// The CUDA driver API, loaded at run time with dlopen("libcuda.so.1"), so that
// lmd._native builds and imports on machines without CUDA.
#pragma once

#include <string>

namespace lmd {

struct CudaProbe {
  bool available = false;  // the driver loaded and cuInit succeeded
  int devices = 0;         // cuDeviceGetCount, 0 when unavailable
  std::string reason;      // why not available, empty when available
};

// Loads libcuda.so.1 once (thread-safe) and asks it how many devices there are.
CudaProbe probe_cuda();

}  // namespace lmd
