#include "host_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "descriptor.h"

namespace lmd {
namespace {

constexpr std::size_t kTokenSize = 16;
// pid, fd, inode, size, token
constexpr std::size_t kPayloadSize = 4 + 4 + 8 + 8 + kTokenSize;

std::string errno_text(int err) { return std::strerror(err); }

class Fd {  // closes on scope exit
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

std::string random_token() {
  std::string token(kTokenSize, '\0');
  std::size_t got = 0;
  while (got < kTokenSize) {
    ssize_t n = getrandom(token.data() + got, kTokenSize - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error("getrandom failed: " + errno_text(errno));
    got += static_cast<std::size_t>(n);
  }
  return token;
}

std::string memfd_name(const std::string& token) {
  static const char* hex = "0123456789abcdef";
  std::string name = "lmd-";
  for (unsigned char c : token) {
    name.push_back(hex[c >> 4]);
    name.push_back(hex[c & 15]);
  }
  return name;
}

// Maps `fd` shared and read-write, prefaulting the page tables so that the first copy
// does not pay a page fault per 4 KiB. Huge pages where the kernel allows them on shmem.
std::unique_ptr<Mapping> map_shared(int fd, std::uint64_t size) {
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) {
    throw std::runtime_error("mmap of " + std::to_string(size) +
                             " bytes of shared memory failed: " + errno_text(errno));
  }
  auto mapping = std::make_unique<Mapping>(addr, size);
  (void)madvise(addr, size, MADV_HUGEPAGE);        // best effort: shmem_enabled may be never
  (void)madvise(addr, size, MADV_POPULATE_WRITE);  // best effort: Linux >= 5.14
  return mapping;
}

std::string fd_target(int fd) {
  char buf[256];
  std::string link = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(link.c_str(), buf, sizeof(buf) - 1);
  return n < 0 ? std::string() : std::string(buf, static_cast<std::size_t>(n));
}

}  // namespace

Mapping::~Mapping() { munmap(address_, length_); }

void Mapping::detach() {
  // If this fails (out of memory for page tables) the shared mapping simply stays
  // until the destructor unmaps it.
  (void)mmap(address_, length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
             -1, 0);
}

HostRegion::HostRegion(std::uintptr_t address, std::uint64_t size, int fd, std::uint64_t inode,
                       std::string token, std::unique_ptr<Mapping> mapping)
    : Region("host", "cpu", address, size),
      shared_(fd >= 0),
      fd_(fd),
      inode_(inode),
      token_(std::move(token)),
      mapping_(std::move(mapping)) {}

HostRegion::~HostRegion() { close(); }

std::shared_ptr<HostRegion> HostRegion::create(std::uint64_t size) {
  if (size == 0) throw std::invalid_argument("region size must be > 0 bytes");
  std::string token = random_token();
  Fd fd(memfd_create(memfd_name(token).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd.get() < 0) throw std::runtime_error("memfd_create failed: " + errno_text(errno));
  if (ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    throw std::runtime_error("sizing shared memory to " + std::to_string(size) +
                             " bytes failed: " + errno_text(errno));
  }
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    throw std::runtime_error("sealing shared memory failed: " + errno_text(errno));
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) throw std::runtime_error("fstat failed: " + errno_text(errno));
  auto mapping = map_shared(fd.get(), size);
  auto address = reinterpret_cast<std::uintptr_t>(mapping->data());
  return std::shared_ptr<HostRegion>(new HostRegion(
      address, size, fd.release(), static_cast<std::uint64_t>(st.st_ino), std::move(token),
      std::move(mapping)));
}

std::shared_ptr<HostRegion> HostRegion::wrap(std::uintptr_t address, std::uint64_t size) {
  if (address == 0) throw std::invalid_argument("cannot register a null pointer");
  if (size == 0) throw std::invalid_argument("region size must be > 0 bytes");
  return std::shared_ptr<HostRegion>(new HostRegion(address, size, -1, 0, {}, nullptr));
}

std::string HostRegion::descriptor() const {
  if (closed()) throw std::invalid_argument("region is closed");
  if (!exportable()) {
    throw std::invalid_argument(
        "this host region wraps memory the process allocated itself and cannot be shared; "
        "allocate the pool with create_region() to export it");
  }
  DescriptorWriter w(TransportKind::host);
  w.put<std::int32_t>(static_cast<std::int32_t>(getpid()));
  w.put<std::int32_t>(fd_);
  w.put<std::uint64_t>(inode_);
  w.put<std::uint64_t>(size());
  w.put_bytes(token_.data(), token_.size());
  return w.bytes();
}

void HostRegion::release() {
  if (mapping_) mapping_->detach();
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

std::shared_ptr<HostRemoteRegion> HostRemoteRegion::open(const std::string& descriptor) {
  DescriptorReader r(descriptor, TransportKind::host, kPayloadSize);
  auto pid = r.get<std::int32_t>();
  auto peer_fd = r.get<std::int32_t>();
  auto inode = r.get<std::uint64_t>();
  auto size = r.get<std::uint64_t>();
  std::string token(kTokenSize, '\0');
  r.get_bytes(token.data(), kTokenSize);
  if (pid <= 0 || peer_fd < 0 || size == 0) {
    throw std::invalid_argument("corrupt host region descriptor");
  }
  std::string who = "host region of process " + std::to_string(pid);
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(peer_fd);
  Fd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (fd.get() < 0) {
    int err = errno;
    if (err == ENOENT) {
      throw std::runtime_error(who + " is gone: the process exited or closed the region");
    }
    throw std::runtime_error("cannot open " + who + " through " + path + ": " +
                             errno_text(err) + " (both processes must run as the same user)");
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) throw std::runtime_error("fstat failed: " + errno_text(errno));
  std::string expected = "/memfd:" + memfd_name(token) + " (deleted)";
  if (static_cast<std::uint64_t>(st.st_ino) != inode || fd_target(fd.get()) != expected) {
    throw std::runtime_error(who + " is gone: its descriptor now names other memory");
  }
  if (static_cast<std::uint64_t>(st.st_size) != size) {
    throw std::runtime_error(who + " has " + std::to_string(st.st_size) +
                             " bytes, its descriptor says " + std::to_string(size));
  }
  auto mapping = map_shared(fd.get(), size);
  return std::shared_ptr<HostRemoteRegion>(new HostRemoteRegion(size, std::move(mapping)));
}

}  // namespace lmd
