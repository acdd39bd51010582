// head/gemm.h: the fused head's GEMMs, row-major, on the calling thread alone: fp32, and
// bf16 operands with fp32 accumulation where the CPU has bf16 dot products.
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
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc);

// gemm() with bf16 A and B (bit patterns) and fp32 C: each product of two bf16 values is exact
// in fp32 and the sums run in fp32, so C has the accuracy of the fp32 GEMM of the widened
// operands (not its bits: another order), except that AVX512-BF16's dot products (VDPBF16PS)
// flush subnormal inputs (below 2^-126) to zero. oneDNN's matmul primitive on those dot
// products (or AMX), or its emulation on AVX-512 without them; on older CPUs (AVX2), the
// operands widened and gemm() above. The head's uses: the logits' tiles (A B^T), and with
// bf16_logit_gradients the gradients' dx W and dx^T h.
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Whether gemm_bf16 runs on bf16 instructions here: the CPU has AVX512-BF16, oneDNN may use
// it (its ONEDNN_MAX_CPU_ISA), and set_bf16_instructions_allowed (cpu/simd_rows.h) has not
// turned them off. Where it does not, the head widens bf16 operands to fp32 itself.
bool bf16_gemm_native();

}  // namespace vpce::detail
