// cpu/parallel.h: the CPU kernels' one threading primitive: body(i) for i in [0, n) over
// OpenMP threads, statically scheduled (so each index's work never depends on the thread
// count), or in order on this thread. An exception a body throws (std::bad_alloc) comes out
// of parallel_rows on the calling thread, as it would without threads: one escaping an
// OpenMP region would terminate the process.
#pragma once

#include <cstdint>
#include <exception>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace vpce::detail {

// The threads a num_threads of 0 (OpenMP's default) or n stands for.
inline int thread_count(int num_threads) {
#if defined(_OPENMP)
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
  return 1;
#endif
}

// body(i, worker) for i in [0, n): `worker` is the index, in [0, threads), of the thread of
// this loop's own team that runs i (0 when the loop runs in order on this thread), for
// per-thread buffers sized by the thread count asked for. Never omp_get_thread_num() outside
// the loop: on the calling thread that is the caller's index in its own team (a caller
// inside an OpenMP parallel region), not this loop's. num_threads: 0 for OpenMP's default, 1
// for this thread alone.
template <class Body>
void parallel_rows_on_workers(int64_t n, int num_threads, const Body& body) {
#if defined(_OPENMP)
  if (num_threads == 1 || n < 2) {
    for (int64_t i = 0; i < n; ++i) body(i, 0);
    return;
  }
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  std::exception_ptr failure;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    try {
      body(i, omp_get_thread_num());
    } catch (...) {
#pragma omp critical(vpce_parallel_rows_failure)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
#else
  (void)num_threads;
  for (int64_t i = 0; i < n; ++i) body(i, 0);
#endif
}

// body(i) for i in [0, n), as parallel_rows_on_workers.
template <class Body>
void parallel_rows(int64_t n, int num_threads, const Body& body) {
  parallel_rows_on_workers(n, num_threads, [&](int64_t i, int) { body(i); });
}

}  // namespace vpce::detail
