// The transfer engine's interface: a Transport registers local memory as Regions,
// exports them as opaque descriptors, opens a peer's descriptor as a RemoteRegion, and
// copies batches of byte ranges from a local Region into a RemoteRegion, returning a
// Ticket to poll or wait on.
//
// Life cycle of a region pair (push, decode-first; docs/architecture.md §6):
//   1. the receiver creates or registers its pool -> Region, sends descriptor() once;
//   2. the sender open()s that descriptor -> RemoteRegion (once per peer);
//   3. the sender submit()s batches of (src_offset, dst_offset, length) -> Ticket;
//   4. poll()/wait() until done, then tells the receiver over its own channel;
//   5. close() on either side; closing twice is a no-op, and a copy still in flight
//      into or out of a closed region never touches freed memory.
//
// Implementations: HostTransport (shared memory), CudaIpcTransport (CUDA IPC). An
// RDMA/NIXL transport plugs in behind the same four verbs.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ticket.h"

namespace lmd {

// One contiguous copy of `length` bytes.
struct CopyOp {
  std::uint64_t src_offset = 0;
  std::uint64_t dst_offset = 0;
  std::uint64_t length = 0;
};

// Memory this process owns or registered, as one transport sees it.
class Region {
 public:
  Region(std::string transport, std::string device, std::uintptr_t address, std::uint64_t size)
      : transport_(std::move(transport)),
        device_(std::move(device)),
        address_(address),
        size_(size) {}
  virtual ~Region() = default;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  const std::string& transport() const { return transport_; }
  const std::string& device() const { return device_; }  // "cpu" or "cuda:N"
  std::uintptr_t address() const { return address_; }
  std::uint64_t size() const { return size_; }
  bool closed() const { return closed_.load(); }

  // Whether descriptor() works: another process can open this region.
  virtual bool exportable() const = 0;
  // Opaque bytes a peer passes to Transport::open. Throws if not exportable or closed.
  virtual std::string descriptor() const = 0;
  // Releases the memory or registration. Idempotent.
  void close() {
    if (!closed_.exchange(true)) release();
  }

 protected:
  virtual void release() = 0;

 private:
  std::string transport_;
  std::string device_;
  std::uintptr_t address_;
  std::uint64_t size_;
  std::atomic<bool> closed_{false};
};

// A peer's region opened from its descriptor.
class RemoteRegion {
 public:
  RemoteRegion(std::string transport, std::string device, std::uint64_t size)
      : transport_(std::move(transport)), device_(std::move(device)), size_(size) {}
  virtual ~RemoteRegion() = default;
  RemoteRegion(const RemoteRegion&) = delete;
  RemoteRegion& operator=(const RemoteRegion&) = delete;

  const std::string& transport() const { return transport_; }
  const std::string& device() const { return device_; }  // as the exporter named it
  std::uint64_t size() const { return size_; }
  bool closed() const { return closed_.load(); }
  void close() {
    if (!closed_.exchange(true)) release();
  }

 protected:
  virtual void release() = 0;

 private:
  std::string transport_;
  std::string device_;
  std::uint64_t size_;
  std::atomic<bool> closed_{false};
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // Allocates exportable memory owned by the region (host: shared memory).
  virtual std::shared_ptr<Region> create_region(std::uint64_t size) = 0;
  // Registers memory the caller owns and keeps alive until the region is closed.
  virtual std::shared_ptr<Region> register_region(std::uintptr_t address, std::uint64_t size,
                                                  const std::string& device) = 0;
  virtual std::shared_ptr<RemoteRegion> open(const std::string& descriptor) = 0;
  // Validates every op against both sizes before any byte moves (std::invalid_argument
  // on the first bad one), then starts the copies. `wait_stream`: a CUDA stream whose
  // work so far must finish before the copies start (cuda_ipc only).
  virtual std::shared_ptr<Ticket> submit(const std::shared_ptr<Region>& src,
                                         const std::shared_ptr<RemoteRegion>& dst,
                                         const std::vector<CopyOp>& ops,
                                         std::optional<std::uintptr_t> wait_stream) = 0;
  // Finishes queued copies and refuses new work. Idempotent.
  virtual void close() = 0;
  virtual bool closed() const = 0;
};

// Checks `ops` against the region sizes (offset + length, overflow-safe) and returns
// them with runs that are contiguous on both sides merged into one copy and empty ops
// dropped. Throws std::invalid_argument naming the first bad op.
std::vector<CopyOp> plan_copies(const std::vector<CopyOp>& ops, std::uint64_t src_size,
                                std::uint64_t dst_size);

// Throws std::invalid_argument unless both regions are open and belong to `transport`.
void check_pair(const Region& src, const RemoteRegion& dst, const std::string& transport);

}  // namespace lmd
