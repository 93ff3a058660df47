// Host memory for the host transport.
//
// An exportable region lives in a sealed memfd (no name in /dev/shm, so nothing can
// leak there and two daemons never collide; the kernel frees it when the last process
// mapping it closes or dies). Its descriptor names the creator's pid, fd, inode and a
// random token; the peer opens /proc/<pid>/fd/<fd> (same user), checks inode and token
// (a reused pid or fd number fails clearly), and maps it. The seals stop any process
// from shrinking the file under another one's mapping.
//
// close() swaps the mapping for private anonymous memory at the same address before
// dropping the shared pages, so a buffer view or in-flight copy that outlives close()
// touches harmless scratch memory instead of unmapped pages; the address range itself
// is unmapped when the last reference (views, tickets) goes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "transport.h"

namespace lmd {

// A mapping [address, address + length) that close() detaches and the destructor unmaps.
class Mapping {
 public:
  Mapping(void* address, std::uint64_t length) : address_(address), length_(length) {}
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  char* data() const { return static_cast<char*>(address_); }
  // Replaces the shared pages with private anonymous ones (see the file comment).
  void detach();

 private:
  void* address_;
  std::uint64_t length_;
};

class HostRegion final : public Region {
 public:
  // `size` bytes of zeroed shared memory, populated up front (a KV pool is allocated once).
  static std::shared_ptr<HostRegion> create(std::uint64_t size);
  // Caller-owned memory at `address`: usable as a copy source, not exportable.
  static std::shared_ptr<HostRegion> wrap(std::uintptr_t address, std::uint64_t size);
  ~HostRegion() override;

  bool exportable() const override { return shared_; }
  std::string descriptor() const override;
  char* data() const { return reinterpret_cast<char*>(address()); }

 protected:
  void release() override;

 private:
  HostRegion(std::uintptr_t address, std::uint64_t size, int fd, std::uint64_t inode,
             std::string token, std::unique_ptr<Mapping> mapping);

  bool shared_;                 // lives in a memfd (else wrapped caller memory)
  int fd_;                      // the memfd until close(), else -1
  std::uint64_t inode_;         // of the memfd, checked by the peer
  std::string token_;           // 16 random bytes, also in the memfd's name
  std::unique_ptr<Mapping> mapping_;  // null for wrapped memory
};

class HostRemoteRegion final : public RemoteRegion {
 public:
  // Maps the region `descriptor` names. std::invalid_argument for bytes that are no
  // host descriptor, std::runtime_error when the region is gone or not accessible.
  static std::shared_ptr<HostRemoteRegion> open(const std::string& descriptor);

  char* data() const { return mapping_->data(); }

 protected:
  void release() override { mapping_->detach(); }

 private:
  HostRemoteRegion(std::uint64_t size, std::unique_ptr<Mapping> mapping)
      : RemoteRegion("host", "cpu", size), mapping_(std::move(mapping)) {}

  std::unique_ptr<Mapping> mapping_;
};

}  // namespace lmd
