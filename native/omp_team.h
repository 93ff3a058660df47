// Work split over the OpenMP team of the runtime the process has already loaded
// (torch's libgomp), so native CPU kernels run on torch's own intra-op threads rather
// than on threads of ours that would compete with them for the cores.
#pragma once

#include <cstdint>
#include <functional>

namespace lmd {

// Calls body(first, last) for contiguous shares of [0, count), one share per thread of
// a team of `threads` (the calling thread one of them); with no OpenMP runtime loaded,
// or one thread, body(0, count) on the calling thread.
void for_shares(std::int64_t count, int threads,
                const std::function<void(std::int64_t, std::int64_t)>& body);

}  // namespace lmd
