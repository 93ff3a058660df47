// One GPU as the cuda_ipc transport uses it: the device's primary context (the one
// PyTorch uses, so its streams and pointers are valid here), a dedicated non-blocking
// copy stream, and the IPC mappings this process opened on it. Shared by the
// transport, its regions and its tickets; whichever goes last releases it.
#pragma once

#include <map>
#include <mutex>
#include <string>

#include "cuda_driver.h"

namespace lmd {

// Makes `ctx` current on this thread for the scope, restoring the previous one.
class ScopedContext {
 public:
  ScopedContext(const CudaDriver& driver, cu::Context ctx);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const CudaDriver& driver_;
};

class CudaDevice {
 public:
  // Retains device `ordinal`'s primary context and creates the copy stream.
  explicit CudaDevice(int ordinal);
  ~CudaDevice();
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  const CudaDriver& driver() const { return driver_; }
  int ordinal() const { return ordinal_; }
  std::string name() const { return "cuda:" + std::to_string(ordinal_); }
  cu::Context context() const { return context_; }
  cu::Stream stream() const { return stream_; }
  // Held while enqueueing on the stream and while touching the IPC mappings.
  std::mutex& mutex() { return mu_; }
  // An event for making the copy stream wait on another stream; use under mutex().
  cu::Event dependency_event() const { return dependency_; }

  // Maps a peer's allocation into this context, or shares an earlier mapping of the same
  // handle (one process may map a handle once). Call under mutex().
  cu::DevicePtr open_ipc(const cu::IpcMemHandle& handle);
  // Drops one reference; the last one waits for queued copies, then unmaps. Never throws
  // (runs from destructors). Call under mutex().
  void close_ipc(const cu::IpcMemHandle& handle);
  // Blocks until every copy queued on the stream finished.
  void synchronize();
  // The batched copy kernel, JIT-compiled into this context on first use; null when the
  // driver cannot load it (then copies go one cuMemcpyAsync per range). Call under mutex().
  cu::Function copy_kernel();

 private:
  struct Mapped {
    cu::DevicePtr base = 0;
    int refs = 0;
  };

  const CudaDriver& driver_;
  int ordinal_;
  cu::Device device_ = 0;
  cu::Context context_ = nullptr;
  cu::Stream stream_ = nullptr;
  cu::Event dependency_ = nullptr;
  bool kernel_tried_ = false;
  cu::Module module_ = nullptr;
  cu::Function kernel_ = nullptr;
  std::mutex mu_;
  std::map<std::string, Mapped> mapped_;  // key: the 64 handle bytes
};

}  // namespace lmd
