// Batched GPU copies in few kernel launches: a batch of many ranges costs one launch per
// kMaxChunks chunks instead of one cuMemcpyAsync (each costs host CPU time) per range.
// The kernel (native/kernels/copy_chunks.cu) ships as PTX the driver compiles at run time.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_driver.h"
#include "transport.h"

namespace lmd {

extern const char kCopyChunksPtx[];
constexpr const char* kCopyChunksName = "lmd_copy_chunks";

constexpr unsigned kMaxChunks = 192;               // LMD_MAX_CHUNKS in the kernel
constexpr std::uint64_t kChunkBytes = 256 * 1024;  // work of one thread block
constexpr unsigned kThreadsPerBlock = 1024;        // __launch_bounds__ in the kernel

// The kernel's parameter, byte for byte.
struct ChunkList {
  std::uint64_t src[kMaxChunks];
  std::uint64_t dst[kMaxChunks];
  std::uint32_t len[kMaxChunks];
  std::uint32_t count;
};
static_assert(sizeof(ChunkList) == 3848, "must match lmd_copy_chunks_param_0 in the PTX");

// Enqueues `plan` (offsets into the regions at src_base / dst_base) on `stream` as
// launches of `kernel`. Throws std::runtime_error if a launch fails.
void launch_chunk_copies(const CudaDriver& driver, cu::Function kernel, cu::Stream stream,
                         cu::DevicePtr src_base, cu::DevicePtr dst_base,
                         const std::vector<CopyOp>& plan);

}  // namespace lmd
