#include "descriptor.h"

#include <stdexcept>

namespace lmd {
namespace {

constexpr char kMagic[4] = {'L', 'M', 'D', 'R'};
constexpr std::uint8_t kVersion = 1;
constexpr std::size_t kHeaderSize = sizeof(kMagic) + 2;  // magic, version, kind

}  // namespace

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::host:
      return "host";
    case TransportKind::cuda_ipc:
      return "cuda_ipc";
  }
  return "unknown";
}

DescriptorWriter::DescriptorWriter(TransportKind kind) {
  out_.append(kMagic, sizeof(kMagic));
  out_.push_back(static_cast<char>(kVersion));
  out_.push_back(static_cast<char>(kind));
}

DescriptorReader::DescriptorReader(const std::string& bytes, TransportKind kind,
                                   std::size_t payload_size)
    : bytes_(bytes), pos_(kHeaderSize) {
  if (bytes.size() < kHeaderSize || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    throw std::invalid_argument("not an lmd region descriptor");
  }
  auto version = static_cast<std::uint8_t>(bytes[4]);
  if (version != kVersion) {
    throw std::invalid_argument("region descriptor version " + std::to_string(version) +
                                " is not " + std::to_string(kVersion) +
                                ": both processes must run the same lmd");
  }
  auto got = static_cast<TransportKind>(static_cast<std::uint8_t>(bytes[5]));
  if (got != kind) {
    throw std::invalid_argument(std::string("region descriptor is for the ") +
                                transport_name(got) + " transport, not " +
                                transport_name(kind));
  }
  if (bytes.size() != kHeaderSize + payload_size) {
    throw std::invalid_argument("region descriptor has " + std::to_string(bytes.size()) +
                                " bytes, expected " +
                                std::to_string(kHeaderSize + payload_size));
  }
}

void DescriptorReader::get_bytes(void* data, std::size_t n) {
  if (pos_ + n > bytes_.size()) throw std::invalid_argument("region descriptor truncated");
  std::memcpy(data, bytes_.data() + pos_, n);
  pos_ += n;
}

}  // namespace lmd
