// cpu/kernels.cc: the kernels of the four stages (see kernels.h).
//
// Rows are cut into blocks of kBlockColumns at fixed offsets; simd_rows.cc does each
// block's SIMD work (statistics in two passes while the block is in cache; the gradient in
// one read and one write). Threads take whole rows, or (row, block) pairs when there are
// fewer rows than threads; either way the blocks are folded in column order, so results do
// not depend on the thread count. The O(tokens) work (merge, loss, reductions) is scalar.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "dtype.h"
#include "parallel.h"
#include "simd_rows.h"

namespace vpce::detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

StorageType storage_of(DataType dtype) {
  return dtype == kFloat32    ? StorageType::kFloat32
         : dtype == kBFloat16 ? StorageType::kBFloat16
                              : StorageType::kFloat16;
}

int64_t block_count(int64_t columns) { return (columns + kBlockColumns - 1) / kBlockColumns; }

// Few rows and many blocks: the (row, block) pairs are spread over the threads instead of
// the rows, with their results in a stack array of this many entries.
constexpr int64_t kMaxSplitItems = 512;

bool split_blocks(int64_t rows, int64_t blocks, int threads) {
  return rows < threads && blocks > 1 && rows * blocks <= kMaxSplitItems;
}

// Runs item(r, b) for every row r and block b: over rows, or over (row, block) pairs when
// rows are fewer than threads. `item` must not depend on which.
template <class Item>
void for_each_block(int64_t rows, int64_t blocks, int num_threads, const Item& item) {
  if (split_blocks(rows, blocks, thread_count(num_threads))) {
    parallel_rows(rows * blocks, num_threads, [&](int64_t k) { item(k / blocks, k % blocks); });
  } else {
    parallel_rows(rows, num_threads, [&](int64_t r) {
      for (int64_t b = 0; b < blocks; ++b) item(r, b);
    });
  }
}

float weight_at(const TokenVector& weights, int64_t i) { return present(weights) ? weights.at<float>(i) : 1.0f; }

// One logit, widened to fp32.
float load_float(const RowMatrix& m, int64_t i, int64_t col) {
  return widen(m.base + (i * m.row_stride + col) * m.dtype.bytes(), m.dtype);
}

}  // namespace

int64_t target_at(const TokenVector& targets, int64_t i) {
  return targets.dtype == kInt64 ? targets.at<int64_t>(i) : targets.at<int32_t>(i);
}

TransformParams logit_transform(const LossParams& p, int64_t row) {
  const RowTransform r = row_transform(p, row);
  return TransformParams{r.scale, r.cap, r.inverse_cap, r.slope_scale};
}

TokenVector token_slice(const TokenVector& v, int64_t begin, int64_t count) {
  TokenVector out = v;
  out.n = count;
  if (v.base != nullptr) out.base = v.base + begin * v.stride * v.dtype.bytes();
  return out;
}

void write_token_stats(const BlockStats& row, float target_logit, int64_t vocab_begin, const LossParams& params,
                       int64_t width, float* out) {
  out[0] = row.max;
  out[1] = static_cast<float>(row.sum_exp);
  out[2] = target_logit;
  out[3] = params.with_sum_logits() ? logit_half_mean(row.sum_logits, row.columns) : 0.0f;
  if (width >= kStatsWidthWithExtras) {
    out[4] = int_as_float_bits(row.argmax < 0 ? int32_t{-1} : static_cast<int32_t>(row.argmax + vocab_begin));
    out[5] = static_cast<float>(row.weighted);
  }
  if (width == kStatsWidthWithSquares) {
    out[6] = static_cast<float>(row.squares);
    out[7] = 0.0f;
  }
}

void local_stats_kernel(const RowMatrix& logits, const TokenVector& targets, int64_t vocab_begin,
                        const LossParams& params, int num_threads, const RowMatrix& stats) {
  const int64_t valid = valid_columns(vocab_begin, logits.cols, params);
  const int64_t blocks = block_count(valid);
  const bool with_extras = stats.cols >= kStatsWidthWithExtras;
  const StorageType type = storage_of(logits.dtype);
  const int element = logits.dtype.bytes();
  auto block = [&](int64_t i, int64_t b) {
    const int64_t begin = b * kBlockColumns;
    return block_stats(logits.base + (i * logits.row_stride + begin) * element, type,
                       std::min(kBlockColumns, valid - begin), logit_transform(params, i), params.with_sum_logits(),
                       with_extras);
  };
  // Writes the row's TokenStats (and extras) from its blocks folded in column order.
  auto finish = [&](int64_t i, const BlockStats& row) {
    const int64_t target_col = target_at(targets, i) - vocab_begin;
    const bool owns_target = target_col >= 0 && target_col < valid;
    const float target_logit =
        owns_target ? transform_one(load_float(logits, i, target_col), logit_transform(params, i)) : kNegInf;
    write_token_stats(row, target_logit, vocab_begin, params, stats.cols, stats.row<float>(i));
  };
  if (split_blocks(logits.rows, blocks, thread_count(num_threads))) {
    BlockStats parts[kMaxSplitItems];
    for_each_block(logits.rows, blocks, num_threads,
                   [&](int64_t i, int64_t b) { parts[i * blocks + b] = block(i, b); });
    for (int64_t i = 0; i < logits.rows; ++i) {
      BlockStats row;
      for (int64_t b = 0; b < blocks; ++b) fold_block(row, parts[i * blocks + b], b * kBlockColumns);
      finish(i, row);
    }
    return;
  }
  parallel_rows(logits.rows, num_threads, [&](int64_t i) {
    BlockStats row;
    for (int64_t b = 0; b < blocks; ++b) fold_block(row, block(i, b), b * kBlockColumns);
    finish(i, row);
  });
}

void merge_stats_kernel(const float* gathered_base, int64_t rank_stride, int ranks, int64_t row_stride,
                        const int64_t* columns, int num_threads, const RowMatrix& stats) {
  const RankColumns rank_columns{columns};
  parallel_rows(stats.rows, num_threads, [&](int64_t i) {
    merge_token(gathered_base + i * row_stride, rank_stride, ranks, stats.cols, rank_columns, stats.row<float>(i));
  });
}

void loss_kernel(const RowMatrix& stats, const TokenVector& targets, const TokenVector& weights,
                 const LossParams& params, int num_threads, const LossOutputs& out) {
  const bool with_extras = stats.cols >= kStatsWidthWithExtras;
  // Token i's weighted loss; writes the per-token outputs other than the loss.
  auto token = [&](int64_t i) {
    const TokenLoss t = token_loss(stats.row<float>(i), target_at(targets, i),
                                   static_cast<double>(weight_at(weights, i)), params, with_extras);
    lse_tokens(out.lse).set(i, t.lse);
    if (present(out.entropy)) out.entropy.at<float>(i) = t.entropy;
    if (present(out.target_is_argmax)) out.target_is_argmax.at<float>(i) = t.target_is_argmax;
    return t.weighted_loss;
  };
  if (params.reduction == Reduction::kNone) {
    parallel_rows(stats.rows, num_threads, [&](int64_t i) { out.loss.at<float>(i) = static_cast<float>(token(i)); });
    return;
  }
  double total = 0.0;  // in token order: the same bits on every rank and thread count
  for (int64_t i = 0; i < stats.rows; ++i) total += token(i);
  if (params.reduction == Reduction::kMean) {
    const double denominator = counted_weight(targets, weights, params);
    total = denominator != 0.0 ? total / denominator : 0.0;
  }
  out.loss.at<float>(0) = static_cast<float>(total);
}

double counted_weight(const TokenVector& targets, const TokenVector& weights, const LossParams& params) {
  double total = 0.0;
  for (int64_t i = 0; i < targets.n; ++i) {
    if (!params.ignored(target_at(targets, i))) total += static_cast<double>(weight_at(weights, i));
  }
  return total;
}

Upstream upstream_of(const TokenVector& grad_loss, const TokenVector& targets, const TokenVector& weights,
                     const LossParams& params) {
  Upstream up;
  if (params.reduction == Reduction::kNone) {
    up.per_token = grad_loss;
    return up;
  }
  up.shared = static_cast<double>(grad_loss.at<float>(0));
  if (params.reduction == Reduction::kMean) {
    const double denominator = counted_weight(targets, weights, params);
    up.shared = denominator != 0.0 ? up.shared / denominator : 0.0;
  }
  return up;
}

void gradient_kernel(const RowMatrix& logits, const TokenVector& targets, const TokenVector& weights,
                     const TokenVector& lse, const TokenVector& grad_loss, int64_t vocab_begin,
                     const LossParams& params, int num_threads, const RowMatrix& grad) {
  gradient_rows_kernel(logits, targets, weights, lse, upstream_of(grad_loss, targets, weights, params), vocab_begin,
                       params, num_threads, grad);
}

void gradient_rows_kernel(const RowMatrix& logits, const TokenVector& targets, const TokenVector& weights,
                          const TokenVector& lse, const Upstream& upstream, int64_t vocab_begin,
                          const LossParams& params, int num_threads, const RowMatrix& grad) {
  const LseTokens token_lse = lse_tokens(lse);
  gradient_rows(
      logits, targets,
      [&](int64_t i) {
        const double g =
            present(upstream.per_token) ? static_cast<double>(upstream.per_token.at<float>(i)) : upstream.shared;
        return gradient_constants(target_at(targets, i), g, weight_at(weights, i), token_lse.get(i), params);
      },
      vocab_begin, params, num_threads, grad);
}

void gradient_rows(const RowMatrix& logits, const TokenVector& targets,
                   const std::function<GradientConstants(int64_t)>& constants, int64_t vocab_begin,
                   const LossParams& params, int num_threads, const RowMatrix& grad) {
  const int64_t valid = valid_columns(vocab_begin, logits.cols, params);
  const double target_term = 1.0 - params.smoothing;
  const int64_t blocks = block_count(valid);
  const StorageType in = storage_of(logits.dtype), out = storage_of(grad.dtype);
  const int in_bytes = logits.dtype.bytes(), out_bytes = grad.dtype.bytes();
  // The target's gradient, from its logit read before the row is overwritten (in place), in
  // fp64 and rounded once: p - 1 cancels where p is about 1.
  auto target_gradient = [&](int64_t i, float x, const GradientConstants& c) {
    const TransformParams transform = logit_transform(params, i);
    const auto z = static_cast<double>(transform_one(x, transform));
    const double p = std::exp(z - c.exact_lse);
    double g = c.exact_upstream * ((p * c.z_loss_factor - c.exact_uniform) - target_term);
    if (c.exact_entropy != 0.0) g += c.exact_entropy * entropy_term(p, z, c.exact_mean_logit);
    if (!transform.identity()) g *= static_cast<double>(slope_one(x, transform));
    return g;
  };
  auto zero = [&](int64_t i, int64_t begin, int64_t end) {
    char* row = grad.base + i * grad.row_stride * out_bytes;
    for (int64_t v = begin; v < end; ++v) narrow(0.0f, row + v * out_bytes, grad.dtype);
  };
  auto block = [&](int64_t i, int64_t b, const GradientConstants& c) {
    const int64_t begin = b * kBlockColumns;
    block_gradient(logits.base + (i * logits.row_stride + begin) * in_bytes, in,
                   grad.base + (i * grad.row_stride + begin) * out_bytes, out, std::min(kBlockColumns, valid - begin),
                   logit_transform(params, i), c);
  };
  // Row i once its blocks are written: the padding, and the target column.
  auto finish = [&](int64_t i, float target_x, const GradientConstants& c) {
    zero(i, valid, logits.cols);
    const int64_t target_col = target_at(targets, i) - vocab_begin;
    if (target_col >= 0 && target_col < valid) {
      narrow(target_gradient(i, target_x, c), grad.base + (i * grad.row_stride + target_col) * out_bytes, grad.dtype);
    }
  };
  auto target_x = [&](int64_t i) {
    const int64_t target_col = target_at(targets, i) - vocab_begin;
    return target_col >= 0 && target_col < valid ? load_float(logits, i, target_col) : 0.0f;
  };
  if (split_blocks(logits.rows, blocks, thread_count(num_threads))) {
    float targets_x[kMaxSplitItems];
    for (int64_t i = 0; i < logits.rows; ++i) targets_x[i] = target_x(i);
    for_each_block(logits.rows, blocks, num_threads, [&](int64_t i, int64_t b) {
      const GradientConstants c = constants(i);
      if (!c.zero_row()) block(i, b, c);
    });
    for (int64_t i = 0; i < logits.rows; ++i) {
      const GradientConstants c = constants(i);
      if (c.zero_row()) {
        zero(i, 0, logits.cols);
      } else {
        finish(i, targets_x[i], c);
      }
    }
    return;
  }
  parallel_rows(logits.rows, num_threads, [&](int64_t i) {
    const GradientConstants c = constants(i);
    if (c.zero_row()) {  // ignored, or weight 0: a row of zeros
      zero(i, 0, logits.cols);
      return;
    }
    const float x = target_x(i);
    for (int64_t b = 0; b < blocks; ++b) block(i, b, c);
    finish(i, x, c);
  });
}

}  // namespace vpce::detail
