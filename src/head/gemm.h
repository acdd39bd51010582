// head/gemm.h: the fused head's one GEMM, fp32, row-major, on the calling thread alone.
//
// Through oneDNN (chosen over OpenBLAS and BLIS by bench/blas_compare.cc, see
// docs/performance.md): its matmul primitive, or dnnl_sgemm for a transposed A (gemm.cc).
// It runs on the calling thread only (the head's tiles are spread over threads by the
// caller, each tile's GEMM on one), so a tile's result never depends on the thread count.
#pragma once

#include <cstdint>

namespace vpce::detail {

// C[m, n] = op(A) op(B) + beta C, where op(A) is [m, k] (A^T when trans_a, A then [k, m])
// and op(B) is [k, n] (B^T when trans_b); lda, ldb, ldc are row strides in elements.
// beta is 0 (C written over; its old contents are never read) or 1 (added into).
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace vpce::detail
