// cpu/kernels.h: the CPU kernels of vpce's four stages, on validated arguments.
//
// Callers (src/loss/, src/head/) validate everything first; the kernels trust their
// arguments, never allocate, never communicate, and compute each token's row on one
// thread in a fixed order, so their results do not depend on the number of threads.
#pragma once

#include <cstdint>
#include <functional>

#include "../common/token_math.h"
#include "../validate.h"
#include "simd_rows.h"

namespace vpce::detail {

// Absent optional token vectors have base == nullptr.
inline bool present(const TokenVector& v) { return v.base != nullptr; }
int64_t target_at(const TokenVector& targets, int64_t i);

// The logit transform of the options (scale, soft-cap) and row i's temperature, as the
// kernels apply it.
TransformParams logit_transform(const LossParams& p, int64_t row);

// Elements [begin, begin + count) of v (absent stays absent).
TokenVector token_slice(const TokenVector& v, int64_t begin, int64_t count);

// One token's stats row out[W] from its columns' statistics folded in column order (`row`,
// argmax counted from the shard's first column) and its transformed target logit (-inf
// when the shard does not hold the target).
void write_token_stats(const BlockStats& row, float target_logit, int64_t vocab_begin, const LossParams& params,
                       int64_t width, float* out);

// logits [N, Vr] (fp32/bf16/fp16), targets [N] -> stats [N, W] float32 (W = 4, 6 with the
// extras, 8 with the squares too), over the global columns [vocab_begin, vocab_begin + Vr).
void local_stats_kernel(const RowMatrix& logits, const TokenVector& targets, int64_t vocab_begin,
                        const LossParams& params, int num_threads, const RowMatrix& stats);

// gathered: `ranks` stats matrices [N, W], rank r's row i at
// gathered_base + r * rank_stride + i * row_stride floats -> stats [N, W], in rank order.
// columns: rank r's valid columns at [r] (to rebase its sum of logits), or null without
// label smoothing.
void merge_stats_kernel(const float* gathered_base, int64_t rank_stride, int ranks, int64_t row_stride,
                        const int64_t* columns, int num_threads, const RowMatrix& stats);

// merged stats [N, W], targets [N], weights [N] or absent -> the outputs.
void loss_kernel(const RowMatrix& stats, const TokenVector& targets, const TokenVector& weights,
                 const LossParams& params, int num_threads, const LossOutputs& out);

// The denominator of the mean: the sum of the counted tokens' weights (1 each without
// weights), summed in token order in fp64.
double counted_weight(const TokenVector& targets, const TokenVector& weights, const LossParams& params);

// The upstream gradient of each token's loss: per token (grad_loss for kNone), or one value
// shared by all (grad_loss, divided by the mean's denominator for kMean).
struct Upstream {
  TokenVector per_token;  // absent for a shared value
  double shared = 0.0;
};
Upstream upstream_of(const TokenVector& grad_loss, const TokenVector& targets, const TokenVector& weights,
                     const LossParams& params);

// gradient_kernel with the upstream gradient given: for rows that are a part of the batch
// (the fused head's tiles), whose mean's denominator counts every token.
void gradient_rows_kernel(const RowMatrix& logits, const TokenVector& targets, const TokenVector& weights,
                          const TokenVector& lse, const Upstream& upstream, int64_t vocab_begin,
                          const LossParams& params, int num_threads, const RowMatrix& grad);

// The gradient rows of any operation: grad [N, Vr] from the logits [N, Vr] and each token's
// GradientConstants (constants(i), called once per row or per block), its target column
// (targets[i] - vocab_begin, if this shard holds it) taking the one-hot term in fp64.
void gradient_rows(const RowMatrix& logits, const TokenVector& targets,
                   const std::function<GradientConstants(int64_t)>& constants, int64_t vocab_begin,
                   const LossParams& params, int num_threads, const RowMatrix& grad);

// logits [N, Vr], targets [N], weights [N] or absent, lse [N], grad_loss ([N] for kNone,
// [1] otherwise) -> grad [N, Vr] (fp32/bf16/fp16), which may be the logits themselves.
void gradient_kernel(const RowMatrix& logits, const TokenVector& targets, const TokenVector& weights,
                     const TokenVector& lse, const TokenVector& grad_loss, int64_t vocab_begin,
                     const LossParams& params, int num_threads, const RowMatrix& grad);

}  // namespace vpce::detail
