// cpu/kernels.h: the CPU kernels of vpce's four stages, on validated arguments.
//
// Callers (src/loss.cc, src/forward.cc) validate everything first; the kernels trust their
// arguments, never allocate, never communicate, and compute each token's row on one
// thread in a fixed order, so their results do not depend on the number of threads.
#pragma once

#include <cstdint>

#include "../common/token_math.h"
#include "../validate.h"

namespace vpce::detail {

// Absent optional token vectors have base == nullptr.
inline bool present(const TokenVector& v) { return v.base != nullptr; }
int64_t target_at(const TokenVector& targets, int64_t i);

// logits [N, Vr] (fp32/bf16/fp16), targets [N] -> stats [N, W] float32 (W = 4, or 6 with
// the extras), over the global columns [vocab_begin, vocab_begin + Vr).
void local_stats_kernel(const RowMatrix& logits, const TokenVector& targets, int64_t vocab_begin,
                        const LossParams& params, int num_threads, const RowMatrix& stats);

// gathered: `ranks` stats matrices [N, W], rank r's row i at
// gathered_base + r * rank_stride + i * row_stride floats -> stats [N, W], in rank order.
void merge_stats_kernel(const float* gathered_base, int64_t rank_stride, int ranks,
                        int64_t row_stride, int num_threads, const RowMatrix& stats);

struct LossOutputs {
  TokenVector loss;              // [N] for kNone, [1] otherwise
  TokenVector lse;               // [N]
  TokenVector target_is_argmax;  // [N] or absent (needs W = 6)
  TokenVector entropy;           // [N] or absent (needs W = 6)
};

// merged stats [N, W], targets [N], weights [N] or absent -> the outputs.
void loss_kernel(const RowMatrix& stats, const TokenVector& targets, const TokenVector& weights,
                 const LossParams& params, int num_threads, const LossOutputs& out);

// The denominator of the mean: the sum of the counted tokens' weights (1 each without
// weights), summed in token order in fp64.
double counted_weight(const TokenVector& targets, const TokenVector& weights,
                      const LossParams& params);

// logits [N, Vr], targets [N], weights [N] or absent, lse [N], grad_loss ([N] for kNone,
// [1] otherwise) -> grad [N, Vr] (fp32/bf16/fp16), which may be the logits themselves.
void gradient_kernel(const RowMatrix& logits, const TokenVector& targets,
                     const TokenVector& weights, const TokenVector& lse,
                     const TokenVector& grad_loss, int64_t vocab_begin,
                     const LossParams& params, int num_threads, const RowMatrix& grad);

}  // namespace vpce::detail
