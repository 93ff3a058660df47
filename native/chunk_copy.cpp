#include "chunk_copy.h"

#include <algorithm>

namespace lmd {

void launch_chunk_copies(const CudaDriver& driver, cu::Function kernel, cu::Stream stream,
                         cu::DevicePtr src_base, cu::DevicePtr dst_base,
                         const std::vector<CopyOp>& plan) {
  ChunkList list{};
  auto launch = [&] {
    void* params[] = {&list};
    driver.check(driver.cuLaunchKernel(kernel, list.count, 1, 1, kThreadsPerBlock, 1, 1, 0,
                                       stream, params, nullptr),
                 "cuLaunchKernel(lmd_copy_chunks)");
    list.count = 0;
  };
  for (const CopyOp& op : plan) {
    for (std::uint64_t done = 0; done < op.length;) {
      std::uint64_t n = std::min(kChunkBytes, op.length - done);
      list.src[list.count] = src_base + op.src_offset + done;
      list.dst[list.count] = dst_base + op.dst_offset + done;
      list.len[list.count] = static_cast<std::uint32_t>(n);
      ++list.count;
      done += n;
      if (list.count == kMaxChunks) launch();
    }
  }
  if (list.count > 0) launch();
}

}  // namespace lmd
