#include "cuda_device.h"

#include <stdexcept>

#include "chunk_copy.h"

namespace lmd {

ScopedContext::ScopedContext(const CudaDriver& driver, cu::Context ctx) : driver_(driver) {
  driver_.check(driver_.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
}

ScopedContext::~ScopedContext() {
  cu::Context previous = nullptr;
  (void)driver_.cuCtxPopCurrent(&previous);
}

CudaDevice::CudaDevice(int ordinal) : driver_(cuda_driver()), ordinal_(ordinal) {
  const CudaDriver& d = driver_;
  d.check(d.cuDeviceGet(&device_, ordinal), "cuDeviceGet");
  d.check(d.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
  try {
    ScopedContext scope(d, context_);
    d.check(d.cuStreamCreate(&stream_, cu::kStreamNonBlocking), "cuStreamCreate");
    d.check(d.cuEventCreate(&dependency_, cu::kEventDisableTiming), "cuEventCreate");
  } catch (...) {
    if (stream_ != nullptr) {
      ScopedContext scope(d, context_);
      (void)d.cuStreamDestroy(stream_);
    }
    (void)d.cuDevicePrimaryCtxRelease(device_);
    throw;
  }
}

CudaDevice::~CudaDevice() {
  const CudaDriver& d = driver_;
  if (d.cuCtxPushCurrent(context_) == cu::kSuccess) {
    (void)d.cuStreamSynchronize(stream_);
    for (auto& [key, mapped] : mapped_) (void)d.cuIpcCloseMemHandle(mapped.base);
    if (module_ != nullptr) (void)d.cuModuleUnload(module_);
    (void)d.cuEventDestroy(dependency_);
    (void)d.cuStreamDestroy(stream_);
    cu::Context previous = nullptr;
    (void)d.cuCtxPopCurrent(&previous);
  }
  (void)d.cuDevicePrimaryCtxRelease(device_);
}

cu::DevicePtr CudaDevice::open_ipc(const cu::IpcMemHandle& handle) {
  std::string key(handle.reserved, cu::kIpcHandleSize);
  auto it = mapped_.find(key);
  if (it != mapped_.end()) {
    ++it->second.refs;
    return it->second.base;
  }
  ScopedContext scope(driver_, context_);
  cu::DevicePtr base = 0;
  // Lazy peer access: the allocation may live on another GPU (NVLink or PCIe peer).
  driver_.check(driver_.cuIpcOpenMemHandle(&base, handle, cu::kIpcMemLazyEnablePeerAccess),
                "cuIpcOpenMemHandle");
  mapped_[key] = Mapped{base, 1};
  return base;
}

void CudaDevice::close_ipc(const cu::IpcMemHandle& handle) {
  auto it = mapped_.find(std::string(handle.reserved, cu::kIpcHandleSize));
  if (it == mapped_.end() || --it->second.refs > 0) return;
  if (driver_.cuCtxPushCurrent(context_) == cu::kSuccess) {
    // Copies into the mapping may still be queued: let them land before unmapping.
    (void)driver_.cuStreamSynchronize(stream_);
    (void)driver_.cuIpcCloseMemHandle(it->second.base);
    cu::Context previous = nullptr;
    (void)driver_.cuCtxPopCurrent(&previous);
  }
  mapped_.erase(it);
}

void CudaDevice::synchronize() {
  ScopedContext scope(driver_, context_);
  driver_.check(driver_.cuStreamSynchronize(stream_), "cuStreamSynchronize");
}

cu::Function CudaDevice::copy_kernel() {
  if (kernel_tried_) return kernel_;
  kernel_tried_ = true;
  ScopedContext scope(driver_, context_);
  if (driver_.cuModuleLoadData(&module_, kCopyChunksPtx) != cu::kSuccess) {
    module_ = nullptr;  // e.g. a driver older than the PTX: fall back to the copy engines
    return nullptr;
  }
  if (driver_.cuModuleGetFunction(&kernel_, module_, kCopyChunksName) != cu::kSuccess) {
    kernel_ = nullptr;
  }
  return kernel_;
}

}  // namespace lmd
