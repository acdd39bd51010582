// head/gemm.cc: gemm() through oneDNN (see gemm.h).
#include "gemm.h"

#include <oneapi/dnnl/dnnl.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace vpce::detail {
namespace {

// oneDNN's OpenMP runtime takes its thread count from omp_get_max_threads() (1 inside a
// parallel region); this makes it 1 on the calling thread for the call, and restores it.
class OneThread {
 public:
#if defined(_OPENMP)
  OneThread() : previous_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(previous_); }

 private:
  int previous_;
#endif
};

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0f) {
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = 0.0f;
      }
    }
    return;
  }
  OneThread one;
  // The arguments were validated by the caller (sizes fit, strides >= row lengths), so
  // oneDNN's own checks cannot fail.
  static_cast<void>(dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, beta, c,
                               ldc));
}

}  // namespace vpce::detail
