// What lmd._native's CPU kernels (panel_gemm.h, paged_attention.h) share: the check that
// this CPU runs them, and work split over the OpenMP team of the runtime the process has
// already loaded (torch's libgomp), so they run on torch's own intra-op threads rather
// than on threads of ours that would compete with them for the cores.
#pragma once

#include <cstdint>
#include <functional>

namespace lmd {

// Does this CPU run the kernels (AVX2 and FMA)?
bool cpu_kernels_supported();

// Calls body(first, last) for contiguous shares of [0, count), one share per thread of
// a team of `threads` (the calling thread one of them); with no OpenMP runtime loaded,
// or one thread, body(0, count) on the calling thread.
void for_shares(std::int64_t count, int threads,
                const std::function<void(std::int64_t, std::int64_t)>& body);

}  // namespace lmd
