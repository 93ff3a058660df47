#include "omp_team.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace lmd {
namespace {

// libgomp's entry points, as `#pragma omp parallel` compiles to them (its ABI since GCC
// 4.9): GOMP_parallel runs fn(data) on a team of num_threads threads, the caller one of
// them, and returns when all have.
struct Gomp {
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
  int (*thread_num)();
  int (*num_threads)();
};

// Paths of the loaded objects whose file name contains `part` (dl_iterate_phdr).
std::vector<std::string> loaded_named(const char* part) {
  std::vector<std::string> found;
  struct Search {
    const char* part;
    std::vector<std::string>* found;
  } search{part, &found};
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name != nullptr && std::strstr(info->dlpi_name, s->part) != nullptr) {
          s->found->emplace_back(info->dlpi_name);
        }
        return 0;
      },
      &search);
  return found;
}

// The OpenMP runtime already loaded (RTLD_NOLOAD: never a second runtime), or none:
// libgomp first (torch's wheels, under whatever name a wheel gives its copy), then
// Intel's and LLVM's, which export the same GOMP_ entry points.
Gomp find_gomp() {
  for (const char* part : {"libgomp", "libiomp5", "libomp"}) {
    for (const std::string& path : loaded_named(part)) {
      void* lib = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
      if (lib == nullptr) continue;
      Gomp gomp{};
      gomp.parallel = reinterpret_cast<decltype(gomp.parallel)>(dlsym(lib, "GOMP_parallel"));
      gomp.thread_num =
          reinterpret_cast<decltype(gomp.thread_num)>(dlsym(lib, "omp_get_thread_num"));
      gomp.num_threads =
          reinterpret_cast<decltype(gomp.num_threads)>(dlsym(lib, "omp_get_num_threads"));
      if (gomp.parallel && gomp.thread_num && gomp.num_threads) return gomp;
    }
  }
  return {};
}

struct Shares {
  std::int64_t count;
  const std::function<void(std::int64_t, std::int64_t)>* body;
  const Gomp* gomp;
};

void run_share(void* data) {
  const Shares& s = *static_cast<const Shares*>(data);
  const std::int64_t t = s.gomp->thread_num();
  const std::int64_t size = s.gomp->num_threads();
  const std::int64_t first = s.count * t / size, last = s.count * (t + 1) / size;
  if (first < last) (*s.body)(first, last);
}

}  // namespace

bool cpu_kernels_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void for_shares(std::int64_t count, int threads,
                const std::function<void(std::int64_t, std::int64_t)>& body) {
  static const Gomp gomp = find_gomp();
  if (gomp.parallel == nullptr || threads <= 1 || count < 2) {
    if (count > 0) body(0, count);
    return;
  }
  Shares shares{count, &body, &gomp};
  gomp.parallel(run_share, &shares, static_cast<unsigned>(std::min<std::int64_t>(threads, count)),
                0);
}

}  // namespace lmd
