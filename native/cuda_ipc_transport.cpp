#include "cuda_ipc_transport.h"

#include <chrono>
#include <stdexcept>
#include <thread>
#include <utility>

#include "chunk_copy.h"
#include "cuda_region.h"

namespace lmd {
namespace {

// Completion of one batch: an event recorded on the copy stream after its copies.
class CudaTicket final : public Ticket {
 public:
  CudaTicket(std::uint64_t nbytes, std::size_t num_copies, std::shared_ptr<CudaDevice> device,
             cu::Event event, std::shared_ptr<const void> keep_alive)
      : Ticket(nbytes, num_copies),
        device_(std::move(device)),
        event_(event),
        keep_alive_(std::move(keep_alive)) {}

  ~CudaTicket() override {
    const CudaDriver& d = device_->driver();
    if (d.cuCtxPushCurrent(device_->context()) == cu::kSuccess) {
      (void)d.cuEventDestroy(event_);  // legal while pending: freed once it completes
      cu::Context previous = nullptr;
      (void)d.cuCtxPopCurrent(&previous);
    }
  }

  bool poll() override {
    const CudaDriver& d = device_->driver();
    ScopedContext scope(d, device_->context());
    cu::Result rc = d.cuEventQuery(event_);
    if (rc == cu::kErrorNotReady) return false;
    d.check(rc, "copy batch failed: cuEventQuery");
    return true;
  }

  bool wait(double timeout_s) override {
    // Polls rather than cuEventSynchronize so that the limit holds. Spins (yielding) for
    // the first 2 ms, since most batches finish within that and a sleep would add its
    // own latency to the migration; then sleeps in short steps.
    using Clock = std::chrono::steady_clock;
    constexpr double kForever = 1e7;
    bool limited = timeout_s >= 0 && timeout_s <= kForever;
    auto start = Clock::now();
    auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(limited ? timeout_s : 0));
    auto spin_until = start + std::chrono::milliseconds(2);
    auto pause = std::chrono::microseconds(20);
    for (;;) {
      if (poll()) return true;
      auto now = Clock::now();
      if (limited && now >= deadline) return false;
      if (now < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(200));
      }
    }
  }

 private:
  std::shared_ptr<CudaDevice> device_;
  cu::Event event_;
  std::shared_ptr<const void> keep_alive_;  // the regions, until the ticket goes
};

}  // namespace

int parse_cuda_device(const std::string& device, int num_devices) {
  const std::string prefix = "cuda:";
  std::string bad = "device must be 'cuda:N' with N below " + std::to_string(num_devices) +
                    ", got '" + device + "'";
  if (device.compare(0, prefix.size(), prefix) != 0 || device.size() == prefix.size() ||
      device.size() > prefix.size() + 4) {
    throw std::invalid_argument(bad);
  }
  int ordinal = 0;
  for (std::size_t i = prefix.size(); i < device.size(); ++i) {
    char c = device[i];
    if (c < '0' || c > '9') throw std::invalid_argument(bad);
    ordinal = ordinal * 10 + (c - '0');
  }
  if (ordinal >= num_devices) throw std::invalid_argument(bad);
  return ordinal;
}

CudaIpcTransport::CudaIpcTransport(const std::string& device, bool copy_kernel)
    : copy_kernel_(copy_kernel) {
  CudaProbe probe = probe_cuda();
  cuda_driver();  // throws with the reason when CUDA is unusable
  device_ = std::make_shared<CudaDevice>(parse_cuda_device(device, probe.devices));
}

void CudaIpcTransport::check_open() const {
  if (closed()) throw std::runtime_error("the cuda_ipc transport is closed");
}

std::shared_ptr<Region> CudaIpcTransport::create_region(std::uint64_t) {
  throw std::invalid_argument(
      "the cuda_ipc transport does not allocate: allocate the pool with torch on " +
      device_->name() + " and register() it");
}

std::shared_ptr<Region> CudaIpcTransport::register_region(std::uintptr_t address,
                                                          std::uint64_t size,
                                                          const std::string& device) {
  check_open();
  if (device != device_->name()) {
    throw std::invalid_argument("this cuda_ipc transport copies on " + device_->name() +
                                "; register memory of that device, not " + device);
  }
  return CudaRegion::wrap(device_, address, size);
}

std::shared_ptr<RemoteRegion> CudaIpcTransport::open(const std::string& descriptor) {
  check_open();
  return CudaRemoteRegion::open(device_, descriptor);
}

std::shared_ptr<Ticket> CudaIpcTransport::submit(const std::shared_ptr<Region>& src,
                                                 const std::shared_ptr<RemoteRegion>& dst,
                                                 const std::vector<CopyOp>& ops,
                                                 std::optional<std::uintptr_t> wait_stream) {
  check_open();
  check_pair(*src, *dst, name());
  auto s = std::dynamic_pointer_cast<CudaRegion>(src);
  auto d = std::dynamic_pointer_cast<CudaRemoteRegion>(dst);
  if (!s || !d) throw std::invalid_argument("regions were not made by a cuda_ipc transport");
  if (s->cuda_device() != device_ || d->cuda_device() != device_) {
    throw std::invalid_argument("both regions must come from this cuda_ipc transport");
  }
  std::vector<CopyOp> plan = plan_copies(ops, s->size(), d->size());
  std::uint64_t total = 0;
  for (const CopyOp& op : plan) total += op.length;

  const CudaDriver& drv = device_->driver();
  std::lock_guard<std::mutex> lock(device_->mutex());
  ScopedContext scope(drv, device_->context());
  cu::Stream stream = device_->stream();
  cu::Event done = nullptr;
  drv.check(drv.cuEventCreate(&done, cu::kEventDisableTiming), "cuEventCreate");
  auto keep_alive = std::make_shared<std::pair<std::shared_ptr<CudaRegion>,
                                               std::shared_ptr<CudaRemoteRegion>>>(s, d);
  // From here on the ticket owns the event, also if enqueueing fails half way.
  auto ticket =
      std::make_shared<CudaTicket>(total, plan.size(), device_, done, std::move(keep_alive));
  if (wait_stream) {
    auto producer = reinterpret_cast<cu::Stream>(*wait_stream);
    drv.check(drv.cuEventRecord(device_->dependency_event(), producer),
              "cuEventRecord(wait_stream)");
    drv.check(drv.cuStreamWaitEvent(stream, device_->dependency_event(), 0),
              "cuStreamWaitEvent");
  }
  auto src_base = static_cast<cu::DevicePtr>(s->address());
  cu::Function kernel = nullptr;
  if (copy_kernel_ && plan.size() > 1 && d->kernel_writable()) kernel = device_->copy_kernel();
  if (kernel != nullptr) {
    launch_chunk_copies(drv, kernel, stream, src_base, d->address(), plan);
  } else {
    for (const CopyOp& op : plan) {
      drv.check(drv.cuMemcpyAsync(d->address() + op.dst_offset, src_base + op.src_offset,
                                  static_cast<std::size_t>(op.length), stream),
                "cuMemcpyAsync");
    }
  }
  drv.check(drv.cuEventRecord(done, stream), "cuEventRecord");
  return ticket;
}

void CudaIpcTransport::close() {
  if (closed_.exchange(true) || !device_) return;
  try {
    device_->synchronize();  // queued copies finish; regions and tickets keep the device
  } catch (const std::exception&) {
    // A sticky CUDA error: the tickets report it.
  }
}

}  // namespace lmd
