// Validation and coalescing of a copy batch, shared by every transport.
#include <stdexcept>
#include <string>

#include "transport.h"

namespace lmd {
namespace {

std::string describe(std::size_t index, const CopyOp& op) {
  return "copy " + std::to_string(index) + " (src_offset=" + std::to_string(op.src_offset) +
         ", dst_offset=" + std::to_string(op.dst_offset) +
         ", length=" + std::to_string(op.length) + ")";
}

// offset + length <= size, without overflow.
bool fits(std::uint64_t offset, std::uint64_t length, std::uint64_t size) {
  return offset <= size && length <= size - offset;
}

}  // namespace

std::vector<CopyOp> plan_copies(const std::vector<CopyOp>& ops, std::uint64_t src_size,
                                std::uint64_t dst_size) {
  std::vector<CopyOp> planned;
  planned.reserve(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const CopyOp& op = ops[i];
    if (!fits(op.src_offset, op.length, src_size)) {
      throw std::invalid_argument(describe(i, op) + " reads past the end of the source region (" +
                                  std::to_string(src_size) + " bytes)");
    }
    if (!fits(op.dst_offset, op.length, dst_size)) {
      throw std::invalid_argument(describe(i, op) +
                                  " writes past the end of the destination region (" +
                                  std::to_string(dst_size) + " bytes)");
    }
    if (op.length == 0) continue;
    if (!planned.empty()) {
      CopyOp& last = planned.back();
      if (last.src_offset + last.length == op.src_offset &&
          last.dst_offset + last.length == op.dst_offset) {
        last.length += op.length;  // both sides contiguous: one larger copy
        continue;
      }
    }
    planned.push_back(op);
  }
  return planned;
}

void check_pair(const Region& src, const RemoteRegion& dst, const std::string& transport) {
  if (src.transport() != transport) {
    throw std::invalid_argument("source region belongs to the " + src.transport() +
                                " transport, not " + transport);
  }
  if (dst.transport() != transport) {
    throw std::invalid_argument("destination region belongs to the " + dst.transport() +
                                " transport, not " + transport);
  }
  if (src.closed()) throw std::invalid_argument("source region is closed");
  if (dst.closed()) throw std::invalid_argument("destination region is closed");
}

}  // namespace lmd
