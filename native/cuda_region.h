// GPU memory as the cuda_ipc transport sees it: local registrations of memory the caller
// allocated (torch tensors), exported as CUDA IPC handles, and peers' regions mapped from
// those handles.
#pragma once

#include <memory>
#include <string>

#include "cuda_device.h"
#include "transport.h"

namespace lmd {

class CudaRegion final : public Region {
 public:
  // Checks that [address, address + size) is device memory of `device` inside one
  // allocation. The caller keeps the memory alive until the region is closed.
  static std::shared_ptr<CudaRegion> wrap(std::shared_ptr<CudaDevice> device,
                                          std::uintptr_t address, std::uint64_t size);

  bool exportable() const override { return true; }
  // Asks the driver for the allocation's IPC handle. Fails for memory that is not
  // IPC-capable (e.g. PyTorch's expandable segments).
  std::string descriptor() const override;
  const std::shared_ptr<CudaDevice>& cuda_device() const { return device_; }

 protected:
  void release() override {}  // the caller owns the memory

 private:
  CudaRegion(std::shared_ptr<CudaDevice> device, std::uintptr_t address, std::uint64_t size,
             cu::DevicePtr base)
      : Region("cuda_ipc", device->name(), address, size),
        device_(std::move(device)),
        base_(base) {}

  std::shared_ptr<CudaDevice> device_;
  cu::DevicePtr base_;  // start of the allocation holding the region
};

class CudaRemoteRegion final : public RemoteRegion {
 public:
  // Maps the region `descriptor` names into `device`'s context. A descriptor from this
  // same process is used directly (IPC cannot open a process's own handles).
  static std::shared_ptr<CudaRemoteRegion> open(std::shared_ptr<CudaDevice> device,
                                                const std::string& descriptor);
  ~CudaRemoteRegion() override { close(); }

  cu::DevicePtr address() const { return address_; }
  const std::shared_ptr<CudaDevice>& cuda_device() const { return device_; }
  // Whether a kernel on this transport's device may write here: an IPC mapping (opened
  // with peer access) or this process's own memory on the same device.
  bool kernel_writable() const { return mapped_ || same_device_; }

 protected:
  void release() override;

 private:
  CudaRemoteRegion(std::shared_ptr<CudaDevice> device, std::string exporter_device,
                   std::uint64_t size, cu::DevicePtr address, bool mapped, bool same_device,
                   const cu::IpcMemHandle& handle)
      : RemoteRegion("cuda_ipc", std::move(exporter_device), size),
        device_(std::move(device)),
        address_(address),
        mapped_(mapped),
        same_device_(same_device),
        handle_(handle) {}

  std::shared_ptr<CudaDevice> device_;
  cu::DevicePtr address_;  // where the region starts in this process
  bool mapped_;            // opened through IPC (else this process's own memory)
  bool same_device_;       // this process's memory on the transport's device
  cu::IpcMemHandle handle_;
};

}  // namespace lmd
