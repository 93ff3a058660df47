// The CUDA driver API, loaded at run time with dlopen("libcuda.so.1"), so that
// lmd._native builds and imports on machines without CUDA. Only the few types and
// entry points the transfer engine uses are declared here (no CUDA headers needed);
// their signatures follow cuda.h of CUDA 12/13.
#pragma once

#include <cstddef>
#include <string>

namespace lmd {

namespace cu {

using Result = int;                      // CUresult
using Device = int;                      // CUdevice
using DevicePtr = unsigned long long;    // CUdeviceptr (64-bit)
using Context = struct CUctx_st*;        // CUcontext
using Stream = struct CUstream_st*;      // CUstream
using Event = struct CUevent_st*;        // CUevent
using Module = struct CUmod_st*;         // CUmodule
using Function = struct CUfunc_st*;      // CUfunction

constexpr std::size_t kIpcHandleSize = 64;  // CU_IPC_HANDLE_SIZE
struct IpcMemHandle {                       // CUipcMemHandle
  char reserved[kIpcHandleSize];
};

constexpr Result kSuccess = 0;            // CUDA_SUCCESS
constexpr Result kErrorNotReady = 600;    // CUDA_ERROR_NOT_READY
constexpr int kPointerAttributeMemoryType = 2;     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;          // CU_MEMORYTYPE_DEVICE
constexpr unsigned kStreamNonBlocking = 1;         // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDisableTiming = 2;        // CU_EVENT_DISABLE_TIMING
constexpr unsigned kIpcMemLazyEnablePeerAccess = 1;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr int kDeviceAttributeComputeCapabilityMajor = 75;  // CU_DEVICE_ATTRIBUTE_..._MAJOR
constexpr int kFuncAttributeMaxDynamicSharedSizeBytes = 8;  // CU_FUNC_ATTRIBUTE_...
constexpr int kDeviceAttributeMultiprocessorCount = 16;  // CU_DEVICE_ATTRIBUTE_..._COUNT
constexpr int kLaunchAttributeCooperative = 2;  // CU_LAUNCH_ATTRIBUTE_COOPERATIVE

struct Dim3 {
  unsigned x, y, z;
};

struct alignas(8) LaunchAttribute {  // CUlaunchAttribute
  int id;
  char pad[4];
  union {
    char bytes[64];
    int cooperative;  // kLaunchAttributeCooperative's value
  } value;
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes");

struct LaunchConfig {  // CUlaunchConfig
  Dim3 grid, block;
  unsigned shared_bytes;
  Stream stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};

}  // namespace cu

// Entry points resolved with dlsym. Versioned names (the `_v2` that cuda.h's macros
// select) are what is loaded where they exist.
struct CudaDriver {
  cu::Result (*cuInit)(unsigned int) = nullptr;
  cu::Result (*cuDeviceGetCount)(int*) = nullptr;
  cu::Result (*cuDeviceGet)(cu::Device*, int) = nullptr;
  cu::Result (*cuGetErrorName)(cu::Result, const char**) = nullptr;
  cu::Result (*cuGetErrorString)(cu::Result, const char**) = nullptr;
  cu::Result (*cuDevicePrimaryCtxRetain)(cu::Context*, cu::Device) = nullptr;
  cu::Result (*cuDevicePrimaryCtxRelease)(cu::Device) = nullptr;
  cu::Result (*cuCtxPushCurrent)(cu::Context) = nullptr;
  cu::Result (*cuCtxPopCurrent)(cu::Context*) = nullptr;
  cu::Result (*cuStreamCreate)(cu::Stream*, unsigned int) = nullptr;
  cu::Result (*cuStreamDestroy)(cu::Stream) = nullptr;
  cu::Result (*cuStreamSynchronize)(cu::Stream) = nullptr;
  cu::Result (*cuStreamWaitEvent)(cu::Stream, cu::Event, unsigned int) = nullptr;
  cu::Result (*cuEventCreate)(cu::Event*, unsigned int) = nullptr;
  cu::Result (*cuEventDestroy)(cu::Event) = nullptr;
  cu::Result (*cuEventRecord)(cu::Event, cu::Stream) = nullptr;
  cu::Result (*cuEventQuery)(cu::Event) = nullptr;
  cu::Result (*cuMemcpyAsync)(cu::DevicePtr, cu::DevicePtr, std::size_t, cu::Stream) = nullptr;
  cu::Result (*cuMemGetAddressRange)(cu::DevicePtr*, std::size_t*, cu::DevicePtr) = nullptr;
  cu::Result (*cuPointerGetAttribute)(void*, int, cu::DevicePtr) = nullptr;
  cu::Result (*cuIpcGetMemHandle)(cu::IpcMemHandle*, cu::DevicePtr) = nullptr;
  cu::Result (*cuIpcOpenMemHandle)(cu::DevicePtr*, cu::IpcMemHandle, unsigned int) = nullptr;
  cu::Result (*cuIpcCloseMemHandle)(cu::DevicePtr) = nullptr;
  cu::Result (*cuModuleLoadData)(cu::Module*, const void*) = nullptr;
  cu::Result (*cuModuleUnload)(cu::Module) = nullptr;
  cu::Result (*cuModuleGetFunction)(cu::Function*, cu::Module, const char*) = nullptr;
  cu::Result (*cuLaunchKernel)(cu::Function, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, unsigned, cu::Stream, void**, void**) = nullptr;
  cu::Result (*cuFuncSetAttribute)(cu::Function, int, int) = nullptr;
  cu::Result (*cuDeviceGetAttribute)(int*, int, cu::Device) = nullptr;
  cu::Result (*cuLaunchKernelEx)(const cu::LaunchConfig*, cu::Function, void**, void**) = nullptr;
  cu::Result (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, cu::Function, int,
                                                            std::size_t) = nullptr;

  // "cuFoo failed: CUDA_ERROR_X (text)" for an error code.
  std::string error(cu::Result rc, const char* call) const;
  // Throws std::runtime_error with error(rc, call) unless rc is CUDA_SUCCESS.
  void check(cu::Result rc, const char* call) const;
};

struct CudaProbe {
  bool available = false;  // the driver loaded and cuInit succeeded
  int devices = 0;         // cuDeviceGetCount, 0 when unavailable
  std::string reason;      // why not available, empty when available
};

// Loads libcuda.so.1 once (thread-safe) and asks it how many devices there are.
CudaProbe probe_cuda();

// The loaded driver with every entry point above resolved and cuInit done. Throws
// std::runtime_error saying why when CUDA is unusable on this machine.
const CudaDriver& cuda_driver();

}  // namespace lmd
