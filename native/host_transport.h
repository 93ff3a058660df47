// The host transport: copies between shared-memory regions of processes on one
// machine (CPU KV pools; CI). Large batches are split across a small thread pool.
#pragma once

#include <atomic>
#include <cstddef>

#include "thread_pool.h"
#include "transport.h"

namespace lmd {

class HostTransport final : public Transport {
 public:
  // `num_threads` copy threads; 0 picks min(cores, 8).
  explicit HostTransport(std::size_t num_threads);
  ~HostTransport() override { close(); }

  std::string name() const override { return "host"; }
  std::size_t num_threads() const { return pool_.size(); }

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

  ThreadPool pool_;
  std::atomic<bool> closed_{false};
};

}  // namespace lmd
