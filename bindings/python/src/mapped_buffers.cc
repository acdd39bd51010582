// bindings/python/src/mapped_buffers.cc: CPU buffers for new gradients (vpce.torch's
// out-of-place backward), each an anonymous mapping of its own on 2 MiB boundaries, advised
// onto transparent huge pages before anything is written (a fresh buffer faulted in 4 KiB
// pages costs far more than the backward itself: docs/performance.md).
//
// Why not PyTorch's CPU allocator: glibc serves a buffer under 32 MiB from its heap once it
// has freed one that large (its mmap threshold rises), and a new gradient every step there
// leaves holes that it keeps resident (a training loop's memory grew 10 MiB more out of
// place than in place; bench/training_memory.py). Why reuse: a new mapping every step
// would fault its pages in every step (0.4-30 ms for 4-16 MiB on a virtual machine, against
// a 0.3-1.5 ms backward). So a freed mapping under 32 MiB goes on a free list for the next
// buffer of its size (its pages resident; the most recently freed of that size first, its
// lines the likeliest in cache), at most 64 MiB kept in all, oldest unmapped first; a larger
// one (which glibc would map and unmap anyway) is unmapped at once.
#include "mapped_buffers.h"

#include <sys/mman.h>

#include <cstdint>
#include <deque>
#include <iterator>
#include <mutex>

namespace vpce::python {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kLargestKept = std::size_t{32} << 20;  // glibc's largest mmap threshold
constexpr std::size_t kMostKeptBytes = std::size_t{64} << 20;

struct Mapping {
  void* base;           // what mmap returned
  std::size_t length;   // what was mapped
  void* data;           // the first 2 MiB boundary in it
  std::size_t rounded;  // the buffer's size rounded up to 2 MiB
};

std::mutex g_mutex;
std::deque<Mapping> g_free;  // oldest first
std::size_t g_free_bytes = 0;
// The live buffers' mappings, by data pointer (few: one per gradient alive).
std::deque<Mapping> g_live;

std::size_t rounded_size(std::size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

}  // namespace

void* acquire_mapped_buffer(std::size_t bytes) {
  const std::size_t rounded = rounded_size(bytes);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (auto it = g_free.rbegin(); it != g_free.rend(); ++it) {
      if (it->rounded == rounded) {
        const Mapping m = *it;
        g_free.erase(std::next(it).base());
        g_free_bytes -= m.length;
        g_live.push_back(m);
        return m.data;
      }
    }
  }
  const std::size_t length = rounded + kHugePage;  // room to start on a 2 MiB boundary
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  const auto address = reinterpret_cast<std::uintptr_t>(base);
  void* data = reinterpret_cast<void*>((address + kHugePage - 1) / kHugePage * kHugePage);
#if defined(MADV_HUGEPAGE)
  madvise(data, rounded, MADV_HUGEPAGE);  // a hint: the kernel may decline (THP disabled)
#endif
  std::lock_guard<std::mutex> lock(g_mutex);
  g_live.push_back({base, length, data, rounded});
  return data;
}

void release_mapped_buffer(void* data) noexcept {
  std::deque<Mapping> unmap;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (auto it = g_live.begin(); it != g_live.end(); ++it) {
      if (it->data != data) continue;
      const Mapping m = *it;
      g_live.erase(it);
      if (m.rounded >= kLargestKept) {
        unmap.push_back(m);
      } else {
        g_free.push_back(m);
        g_free_bytes += m.length;
        while (g_free_bytes > kMostKeptBytes) {
          unmap.push_back(g_free.front());
          g_free_bytes -= g_free.front().length;
          g_free.pop_front();
        }
      }
      break;
    }
  }
  for (const Mapping& m : unmap) munmap(m.base, m.length);
}

std::size_t kept_mapped_buffers() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_free.size();
}

std::size_t kept_mapped_bytes() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_free_bytes;
}

}  // namespace vpce::python
