#include "cuda_region.h"

#include <unistd.h>

#include <stdexcept>

#include "descriptor.h"

namespace lmd {
namespace {

// pid, exporter's ordinal, allocation base, offset of the region in it, size, handle
constexpr std::size_t kPayloadSize = 4 + 4 + 8 + 8 + 8 + cu::kIpcHandleSize;

}  // namespace

std::shared_ptr<CudaRegion> CudaRegion::wrap(std::shared_ptr<CudaDevice> device,
                                             std::uintptr_t address, std::uint64_t size) {
  if (address == 0) throw std::invalid_argument("cannot register a null pointer");
  if (size == 0) throw std::invalid_argument("region size must be > 0 bytes");
  const CudaDriver& d = device->driver();
  ScopedContext scope(d, device->context());
  auto ptr = static_cast<cu::DevicePtr>(address);
  unsigned memory_type = 0;
  if (d.cuPointerGetAttribute(&memory_type, cu::kPointerAttributeMemoryType, ptr) !=
          cu::kSuccess ||
      memory_type != cu::kMemoryTypeDevice) {
    throw std::invalid_argument("address " + std::to_string(address) +
                                " is not CUDA device memory");
  }
  int ordinal = -1;
  d.check(d.cuPointerGetAttribute(&ordinal, cu::kPointerAttributeDeviceOrdinal, ptr),
          "cuPointerGetAttribute(DEVICE_ORDINAL)");
  if (ordinal != device->ordinal()) {
    throw std::invalid_argument("memory at " + std::to_string(address) + " is on cuda:" +
                                std::to_string(ordinal) + ", this transport copies on " +
                                device->name());
  }
  cu::DevicePtr base = 0;
  std::size_t allocation = 0;
  d.check(d.cuMemGetAddressRange(&base, &allocation, ptr), "cuMemGetAddressRange");
  std::uint64_t offset = ptr - base;
  if (size > allocation - offset) {
    throw std::invalid_argument("region of " + std::to_string(size) +
                                " bytes runs past the end of its CUDA allocation (" +
                                std::to_string(allocation - offset) + " bytes left)");
  }
  return std::shared_ptr<CudaRegion>(new CudaRegion(std::move(device), address, size, base));
}

std::string CudaRegion::descriptor() const {
  if (closed()) throw std::invalid_argument("region is closed");
  const CudaDriver& d = device_->driver();
  cu::IpcMemHandle handle{};
  {
    ScopedContext scope(d, device_->context());
    cu::Result rc = d.cuIpcGetMemHandle(&handle, base_);
    if (rc != cu::kSuccess) {
      throw std::runtime_error(d.error(rc, "cuIpcGetMemHandle") +
                               "; the memory must come from cudaMalloc (with PyTorch, leave "
                               "expandable_segments off for the KV pool)");
    }
  }
  DescriptorWriter w(TransportKind::cuda_ipc);
  w.put<std::int32_t>(static_cast<std::int32_t>(getpid()));
  w.put<std::int32_t>(device_->ordinal());
  w.put<std::uint64_t>(base_);
  w.put<std::uint64_t>(static_cast<std::uint64_t>(address()) - base_);
  w.put<std::uint64_t>(size());
  w.put_bytes(handle.reserved, cu::kIpcHandleSize);
  return w.bytes();
}

std::shared_ptr<CudaRemoteRegion> CudaRemoteRegion::open(std::shared_ptr<CudaDevice> device,
                                                         const std::string& descriptor) {
  DescriptorReader r(descriptor, TransportKind::cuda_ipc, kPayloadSize);
  auto pid = r.get<std::int32_t>();
  auto ordinal = r.get<std::int32_t>();
  auto base = r.get<std::uint64_t>();
  auto offset = r.get<std::uint64_t>();
  auto size = r.get<std::uint64_t>();
  cu::IpcMemHandle handle{};
  r.get_bytes(handle.reserved, cu::kIpcHandleSize);
  if (pid <= 0 || ordinal < 0 || size == 0 || base == 0) {
    throw std::invalid_argument("corrupt cuda_ipc region descriptor");
  }
  // Named as the exporter sees it: ordinals can differ between processes.
  std::string exporter = "cuda:" + std::to_string(ordinal);
  if (pid == static_cast<std::int32_t>(getpid())) {
    bool same_device = ordinal == device->ordinal();
    return std::shared_ptr<CudaRemoteRegion>(new CudaRemoteRegion(
        std::move(device), exporter, size, base + offset, false, same_device, handle));
  }
  cu::DevicePtr mapped = 0;
  {
    std::lock_guard<std::mutex> lock(device->mutex());
    mapped = device->open_ipc(handle);
    // A corrupt or stale descriptor must not let copies run past the allocation.
    const CudaDriver& d = device->driver();
    ScopedContext scope(d, device->context());
    cu::DevicePtr start = 0;
    std::size_t allocation = 0;
    cu::Result rc = d.cuMemGetAddressRange(&start, &allocation, mapped);
    if (rc != cu::kSuccess || offset > allocation || size > allocation - offset) {
      device->close_ipc(handle);
      throw std::invalid_argument("cuda_ipc region descriptor names " + std::to_string(size) +
                                  " bytes at offset " + std::to_string(offset) +
                                  " of an allocation of " + std::to_string(allocation));
    }
  }
  return std::shared_ptr<CudaRemoteRegion>(
      new CudaRemoteRegion(std::move(device), exporter, size, mapped + offset, true, false, handle));
}

void CudaRemoteRegion::release() {
  if (!mapped_) return;
  std::lock_guard<std::mutex> lock(device_->mutex());
  device_->close_ipc(handle_);
}

}  // namespace lmd
