// The cuda_ipc transport's batched copy: one launch copies up to LMD_MAX_CHUNKS byte
// ranges ("chunks", each under 4 GiB), one thread block per chunk. The chunk list is
// the kernel parameter itself (3,848 bytes, under the 4 KiB limit), so no device buffer
// has to outlive the launch; the host splits a batch into chunks (native/chunk_copy.cpp,
// whose ChunkList must match this one) and launches as often as needed. 16-byte loads
// and stores where source and destination are 16-byte aligned, bytes otherwise.
//
// Not compiled by setup.py: its PTX (native/kernels/copy_chunks.ptx) is embedded and JIT-
// compiled by the driver at run time, so lmd builds without nvcc. After editing, run
// native/kernels/make_ptx.sh (needs nvcc) to regenerate that file.
#define LMD_MAX_CHUNKS 192

struct ChunkList {
  unsigned long long src[LMD_MAX_CHUNKS];
  unsigned long long dst[LMD_MAX_CHUNKS];
  unsigned int len[LMD_MAX_CHUNKS];
  unsigned int count;
};

extern "C" __global__ void __launch_bounds__(1024) lmd_copy_chunks(const ChunkList chunks) {
  const unsigned int c = blockIdx.x;
  if (c >= chunks.count) return;
  const char* src = reinterpret_cast<const char*>(chunks.src[c]);
  char* dst = reinterpret_cast<char*>(chunks.dst[c]);
  const unsigned int len = chunks.len[c];
  unsigned int done = 0;
  if ((((unsigned long long)src | (unsigned long long)dst) & 15) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    const unsigned int n = len >> 4;
    unsigned int i = threadIdx.x;
    // Four loads in flight per thread before the stores: enough bytes in flight per SM
    // to keep HBM and NVLink busy with few resident blocks.
    for (; i + 3 * blockDim.x < n; i += 4 * blockDim.x) {
      uint4 a = s[i];
      uint4 b = s[i + blockDim.x];
      uint4 e = s[i + 2 * blockDim.x];
      uint4 f = s[i + 3 * blockDim.x];
      d[i] = a;
      d[i + blockDim.x] = b;
      d[i + 2 * blockDim.x] = e;
      d[i + 3 * blockDim.x] = f;
    }
    for (; i < n; i += blockDim.x) d[i] = s[i];
    done = n << 4;
  }
  for (unsigned int i = done + threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
}
