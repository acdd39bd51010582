// cpu/kernels.h: the CPU kernels of vpce's four stages, on validated arguments.
//
// Callers (src/loss.cc, src/forward.cc) validate everything first; the kernels trust their
// arguments, never allocate, never communicate, and compute each token's row on one
// thread in a fixed order, so their results do not depend on the number of threads.
#pragma once

#include <cstdint>

#include "../validate.h"

namespace vpce::detail {

// The constants of the loss for a global vocabulary V and label smoothing a (Megatron's
// semantics): s = a V / (V - 1), and the gradient's uniform term s / V.
struct SmoothingTerms {
  double weight = 0.0;  // s
  bool enabled() const { return weight != 0.0; }
};
SmoothingTerms smoothing_terms(float label_smoothing, int64_t vocab_size);

// logits [N, Vr] (fp32/bf16/fp16), targets [N] (int32/int64, validated in [0, V))
//   -> stats [N, 4] float32 (TokenStats rows), over the columns [vocab_begin, +Vr).
void local_stats_kernel(const RowMatrix& logits, const TokenVector& targets,
                        int64_t vocab_begin, bool with_sum_logits, int num_threads,
                        const RowMatrix& stats);

// gathered: `ranks` stats matrices [N, 4], rank r's rows at gathered_base + r * rank_stride
// floats -> stats [N, 4], merged in rank order.
void merge_stats_kernel(const float* gathered_base, int64_t rank_stride, int ranks,
                        int64_t num_tokens, int64_t row_stride, int num_threads,
                        const RowMatrix& stats);

// merged stats [N, 4] -> loss [N], lse [N] (float32).
void loss_kernel(const RowMatrix& stats, int64_t vocab_size, SmoothingTerms smoothing,
                 int num_threads, const TokenVector& loss, const TokenVector& lse);

// logits [N, Vr], targets [N], lse [N], grad_loss [N] -> grad [N, Vr] (fp32/bf16/fp16),
// grad may be the logits themselves (same base, dtype and row stride).
void gradient_kernel(const RowMatrix& logits, const TokenVector& targets, const TokenVector& lse,
                     const TokenVector& grad_loss, int64_t vocab_begin, int64_t vocab_size,
                     SmoothingTerms smoothing, int num_threads, const RowMatrix& grad);

}  // namespace vpce::detail
