#include "host_transport.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <utility>

#include "host_region.h"

namespace lmd {
namespace {

// Below this many bytes a batch is copied inside submit(): waking a worker costs more
// (tens of microseconds) than the copy.
constexpr std::uint64_t kInlineBytes = 256 * 1024;
// The least work worth a thread of its own.
constexpr std::uint64_t kMinPartBytes = 1024 * 1024;
constexpr std::size_t kMaxDefaultThreads = 8;

struct Segment {
  const char* src;
  char* dst;
  std::size_t length;
};
using Part = std::vector<Segment>;

std::size_t default_threads() {
  std::size_t cores = std::thread::hardware_concurrency();
  return std::clamp<std::size_t>(cores, 1, kMaxDefaultThreads);
}

void copy_part(const Part& part) {
  for (const Segment& s : part) std::memcpy(s.dst, s.src, s.length);
}

// Cuts `ops` into `num_parts` runs of about equal bytes, splitting single ops as needed.
std::vector<Part> split(const std::vector<CopyOp>& ops, std::uint64_t total, std::size_t num_parts,
                        const char* src, char* dst) {
  std::vector<Part> parts(num_parts);
  std::uint64_t target = (total + num_parts - 1) / num_parts;
  std::size_t p = 0;
  std::uint64_t filled = 0;  // bytes in parts[p]
  for (const CopyOp& op : ops) {
    std::uint64_t done = 0;
    while (done < op.length) {
      if (filled == target && p + 1 < num_parts) {
        ++p;
        filled = 0;
      }
      std::uint64_t room = p + 1 < num_parts ? target - filled : op.length - done;
      std::uint64_t n = std::min(room, op.length - done);
      parts[p].push_back({src + op.src_offset + done, dst + op.dst_offset + done,
                          static_cast<std::size_t>(n)});
      done += n;
      filled += n;
    }
  }
  return parts;
}

}  // namespace

HostTransport::HostTransport(std::size_t num_threads)
    : pool_(num_threads == 0 ? default_threads() : num_threads) {}

void HostTransport::check_open() const {
  if (closed()) throw std::runtime_error("the host transport is closed");
}

std::shared_ptr<Region> HostTransport::create_region(std::uint64_t size) {
  check_open();
  return HostRegion::create(size);
}

std::shared_ptr<Region> HostTransport::register_region(std::uintptr_t address,
                                                       std::uint64_t size,
                                                       const std::string& device) {
  check_open();
  if (device != "cpu") {
    throw std::invalid_argument("the host transport registers cpu memory, not " + device);
  }
  return HostRegion::wrap(address, size);
}

std::shared_ptr<RemoteRegion> HostTransport::open(const std::string& descriptor) {
  check_open();
  return HostRemoteRegion::open(descriptor);
}

std::shared_ptr<Ticket> HostTransport::submit(const std::shared_ptr<Region>& src,
                                              const std::shared_ptr<RemoteRegion>& dst,
                                              const std::vector<CopyOp>& ops,
                                              std::optional<std::uintptr_t> wait_stream) {
  check_open();
  if (wait_stream) {
    throw std::invalid_argument("wait_stream names a CUDA stream; the host transport takes none");
  }
  check_pair(*src, *dst, name());
  auto s = std::dynamic_pointer_cast<HostRegion>(src);
  auto d = std::dynamic_pointer_cast<HostRemoteRegion>(dst);
  if (!s || !d) throw std::invalid_argument("regions were not made by a host transport");

  std::vector<CopyOp> plan = plan_copies(ops, s->size(), d->size());
  std::uint64_t total = 0;
  for (const CopyOp& op : plan) total += op.length;
  // The regions stay mapped until the last part finished, whatever the caller closes.
  auto keep_alive = std::make_shared<std::pair<std::shared_ptr<HostRegion>,
                                               std::shared_ptr<HostRemoteRegion>>>(s, d);

  if (total <= kInlineBytes) {
    copy_part(split(plan, total, 1, s->data(), d->data())[0]);
    return std::make_shared<CountdownTicket>(total, plan.size(), 0, nullptr);
  }
  std::size_t num_parts = static_cast<std::size_t>(
      std::min<std::uint64_t>(pool_.size(), (total + kMinPartBytes - 1) / kMinPartBytes));
  std::vector<Part> parts = split(plan, total, num_parts, s->data(), d->data());
  auto ticket = std::make_shared<CountdownTicket>(total, plan.size(), parts.size(), keep_alive);
  for (Part& part : parts) {
    bool queued = pool_.post([ticket, part = std::move(part)] {
      copy_part(part);
      ticket->finish();
    });
    if (!queued) ticket->finish("the host transport was closed before the copy started");
  }
  return ticket;
}

void HostTransport::close() {
  closed_.store(true);
  pool_.shutdown();
}

}  // namespace lmd
