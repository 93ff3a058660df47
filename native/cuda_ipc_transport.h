// The cuda_ipc transport: copies from this process's GPU memory into a peer process's
// GPU memory (same GPU, or a peer GPU over NVLink/PCIe) through CUDA IPC handles. A
// batch goes on a dedicated stream, followed by one event that the ticket polls: a
// single range as one cuMemcpyAsync (copy engines, no SMs taken), several ranges as a
// few launches of a copy kernel (chunk_copy.h), since each cuMemcpyAsync costs host CPU
// time and a migration of small blocks would otherwise run at a few % of the link's
// bandwidth (docs/benchmarks.md, "KV transfer"). The driver is loaded at run time.
#pragma once

#include <atomic>
#include <memory>

#include "cuda_device.h"
#include "transport.h"

namespace lmd {

class CudaIpcTransport final : public Transport {
 public:
  // `device` is "cuda:N". `copy_kernel` false: always one cuMemcpyAsync per range
  // (leaves the SMs to compute, at a launch cost per range). Throws std::runtime_error
  // when CUDA is unavailable.
  CudaIpcTransport(const std::string& device, bool copy_kernel);
  ~CudaIpcTransport() override { close(); }

  std::string name() const override { return "cuda_ipc"; }
  std::string device() const { return device_->name(); }

  // Always throws: GPU pools are allocated by the caller (torch) and registered.
  std::shared_ptr<Region> create_region(std::uint64_t size) override;
  std::shared_ptr<Region> register_region(std::uintptr_t address, std::uint64_t size,
                                          const std::string& device) override;
  std::shared_ptr<RemoteRegion> open(const std::string& descriptor) override;
  std::shared_ptr<Ticket> submit(const std::shared_ptr<Region>& src,
                                 const std::shared_ptr<RemoteRegion>& dst,
                                 const std::vector<CopyOp>& ops,
                                 std::optional<std::uintptr_t> wait_stream) override;
  void close() override;
  bool closed() const override { return closed_.load(); }

 private:
  void check_open() const;

  std::shared_ptr<CudaDevice> device_;
  bool copy_kernel_;
  std::atomic<bool> closed_{false};
};

// Parses "cuda:N" into N, checked against the driver's device count.
int parse_cuda_device(const std::string& device, int num_devices);

}  // namespace lmd
