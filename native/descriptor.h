// The byte layout of region descriptors: a fixed header naming the transport, then
// fixed-width fields in native byte order (peers run on the same machine or at least
// the same architecture; RDMA descriptors will carry their own layout after the header).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace lmd {

enum class TransportKind : std::uint8_t { host = 1, cuda_ipc = 2 };

const char* transport_name(TransportKind kind);

class DescriptorWriter {
 public:
  explicit DescriptorWriter(TransportKind kind);
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    put_bytes(&value, sizeof(T));
  }
  void put_bytes(const void* data, std::size_t n) {
    out_.append(static_cast<const char*>(data), n);
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

class DescriptorReader {
 public:
  // Throws std::invalid_argument unless `bytes` is a descriptor of `kind` whose payload
  // is exactly `payload_size` bytes.
  DescriptorReader(const std::string& bytes, TransportKind kind, std::size_t payload_size);
  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    get_bytes(&value, sizeof(T));
    return value;
  }
  void get_bytes(void* data, std::size_t n);

 private:
  const std::string& bytes_;
  std::size_t pos_;
};

}  // namespace lmd
