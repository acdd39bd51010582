// cpu/kernels.cc: portable C++ kernels of the four stages (see kernels.h).
//
// One token's row is handled by one thread: max over the row, then the sum of
// exp(z - max) (fp32 exp, fp64 accumulation) while the row is still in cache; the
// gradient reads each logit once and writes each gradient element once.
#include "kernels.h"

#include <cmath>
#include <limits>

#include "dtype.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace vpce::detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t target_at(const TokenVector& targets, int64_t i) {
  return targets.dtype == kInt64 ? targets.at<int64_t>(i) : targets.at<int32_t>(i);
}

// Runs body(i) for i in [0, n) over OpenMP threads, statically scheduled.
template <class Body>
void parallel_rows(int64_t n, int num_threads, const Body& body) {
#if defined(_OPENMP)
  if (num_threads == 1 || n < 2) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) body(i);
#else
  (void)num_threads;
  for (int64_t i = 0; i < n; ++i) body(i);
#endif
}

// row: [cols] of T -> one TokenStats.
template <class T>
TokenStats row_stats(const T* row, int64_t cols, int64_t target_col, bool with_sum_logits) {
  float max = kNegInf;
  for (int64_t v = 0; v < cols; ++v) {
    const float z = to_float(row[v]);
    max = z > max ? z : max;
  }
  double sum_exp = 0.0;
  double sum_logits = 0.0;
  if (max != kNegInf) {
    for (int64_t v = 0; v < cols; ++v) {
      const float z = to_float(row[v]);
      sum_exp += static_cast<double>(std::exp(z - max));
      sum_logits += static_cast<double>(z);
    }
  } else if (cols > 0) {
    sum_logits = -std::numeric_limits<double>::infinity();  // every column is -inf
  }
  const bool owns_target = target_col >= 0 && target_col < cols;
  return TokenStats{max, static_cast<float>(sum_exp),
                    owns_target ? to_float(row[target_col]) : kNegInf,
                    with_sum_logits ? static_cast<float>(sum_logits) : 0.0f};
}

template <class T>
void local_stats_typed(const RowMatrix& logits, const TokenVector& targets, int64_t vocab_begin,
                       bool with_sum_logits, int num_threads, const RowMatrix& stats) {
  parallel_rows(logits.rows, num_threads, [&](int64_t i) {
    const int64_t target_col = target_at(targets, i) - vocab_begin;
    const TokenStats out = row_stats(logits.row<const T>(i), logits.cols, target_col,
                                     with_sum_logits);
    float* row = stats.row<float>(i);
    row[0] = out.max;
    row[1] = out.sum_exp;
    row[2] = out.target_logit;
    row[3] = out.sum_logits;
  });
}

// row: [cols] of T -> grad row [cols] of G; the row may be the grad row itself.
template <class T, class G>
void row_gradient(const T* row, G* grad, int64_t cols, int64_t target_col, float lse,
                  float upstream, float uniform, float target_weight) {
  const bool owns_target = target_col >= 0 && target_col < cols;
  const float target_logit = owns_target ? to_float(row[target_col]) : 0.0f;  // read first
  for (int64_t v = 0; v < cols; ++v) {
    const float p = std::exp(to_float(row[v]) - lse);
    grad[v] = from_float<G>(upstream * (p - uniform));
  }
  if (owns_target) {
    const float p = std::exp(target_logit - lse);
    grad[target_col] = from_float<G>(upstream * ((p - uniform) - target_weight));
  }
}

template <class T, class G>
void gradient_typed(const RowMatrix& logits, const TokenVector& targets, const TokenVector& lse,
                    const TokenVector& grad_loss, int64_t vocab_begin, int64_t vocab_size,
                    SmoothingTerms smoothing, int num_threads, const RowMatrix& grad) {
  const auto uniform = static_cast<float>(smoothing.weight / static_cast<double>(vocab_size));
  const auto target_weight = static_cast<float>(1.0 - smoothing.weight);
  parallel_rows(logits.rows, num_threads, [&](int64_t i) {
    row_gradient(logits.row<const T>(i), grad.row<G>(i), logits.cols,
                 target_at(targets, i) - vocab_begin, lse.at<float>(i), grad_loss.at<float>(i),
                 uniform, target_weight);
  });
}

template <class T>
void gradient_for_input(const RowMatrix& logits, const TokenVector& targets,
                        const TokenVector& lse, const TokenVector& grad_loss,
                        int64_t vocab_begin, int64_t vocab_size, SmoothingTerms smoothing,
                        int num_threads, const RowMatrix& grad) {
  if (grad.dtype == kFloat32) {
    gradient_typed<T, float>(logits, targets, lse, grad_loss, vocab_begin, vocab_size, smoothing,
                             num_threads, grad);
  } else if (grad.dtype == kBFloat16) {
    gradient_typed<T, BFloat16>(logits, targets, lse, grad_loss, vocab_begin, vocab_size,
                                smoothing, num_threads, grad);
  } else {
    gradient_typed<T, Float16>(logits, targets, lse, grad_loss, vocab_begin, vocab_size,
                               smoothing, num_threads, grad);
  }
}

}  // namespace

SmoothingTerms smoothing_terms(float label_smoothing, int64_t vocab_size) {
  if (label_smoothing == 0.0f) return {};
  const auto v = static_cast<double>(vocab_size);
  return SmoothingTerms{static_cast<double>(label_smoothing) * v / (v - 1.0)};
}

void local_stats_kernel(const RowMatrix& logits, const TokenVector& targets,
                        int64_t vocab_begin, bool with_sum_logits, int num_threads,
                        const RowMatrix& stats) {
  if (logits.dtype == kFloat32) {
    local_stats_typed<float>(logits, targets, vocab_begin, with_sum_logits, num_threads, stats);
  } else if (logits.dtype == kBFloat16) {
    local_stats_typed<BFloat16>(logits, targets, vocab_begin, with_sum_logits, num_threads,
                                stats);
  } else {
    local_stats_typed<Float16>(logits, targets, vocab_begin, with_sum_logits, num_threads, stats);
  }
}

void merge_stats_kernel(const float* gathered_base, int64_t rank_stride, int ranks,
                        int64_t num_tokens, int64_t row_stride, int num_threads,
                        const RowMatrix& stats) {
  parallel_rows(num_tokens, num_threads, [&](int64_t i) {
    float max = kNegInf;
    float target_logit = kNegInf;
    for (int r = 0; r < ranks; ++r) {
      const float* part = gathered_base + r * rank_stride + i * row_stride;
      max = part[0] > max ? part[0] : max;
      target_logit = part[2] > target_logit ? part[2] : target_logit;
    }
    double sum_exp = 0.0;
    double sum_logits = 0.0;
    for (int r = 0; r < ranks; ++r) {
      const float* part = gathered_base + r * rank_stride + i * row_stride;
      if (part[0] != kNegInf) {  // an all -inf shard adds nothing (and -inf - -inf is NaN)
        sum_exp += static_cast<double>(part[1]) *
                   std::exp(static_cast<double>(part[0]) - static_cast<double>(max));
      }
      sum_logits += static_cast<double>(part[3]);
    }
    float* out = stats.row<float>(i);
    out[0] = max;
    out[1] = static_cast<float>(sum_exp);
    out[2] = target_logit;
    out[3] = static_cast<float>(sum_logits);
  });
}

void loss_kernel(const RowMatrix& stats, int64_t vocab_size, SmoothingTerms smoothing,
                 int num_threads, const TokenVector& loss, const TokenVector& lse) {
  const double s = smoothing.weight;
  const auto v = static_cast<double>(vocab_size);
  parallel_rows(stats.rows, num_threads, [&](int64_t i) {
    const float* st = stats.row<float>(i);
    const auto max = static_cast<double>(st[0]);
    const double log_sum = std::log(static_cast<double>(st[1]));
    // lse - z_target, as (max - z_target) + log(sum): exact subtraction of nearby values.
    const double nll = (max - static_cast<double>(st[2])) + log_sum;
    double value = nll;
    if (smoothing.enabled()) {
      const double uniform_nll = (max - static_cast<double>(st[3]) / v) + log_sum;
      value = (1.0 - s) * nll + s * uniform_nll;
    }
    loss.at<float>(i) = static_cast<float>(value);
    lse.at<float>(i) = static_cast<float>(max + log_sum);
  });
}

void gradient_kernel(const RowMatrix& logits, const TokenVector& targets, const TokenVector& lse,
                     const TokenVector& grad_loss, int64_t vocab_begin, int64_t vocab_size,
                     SmoothingTerms smoothing, int num_threads, const RowMatrix& grad) {
  if (logits.dtype == kFloat32) {
    gradient_for_input<float>(logits, targets, lse, grad_loss, vocab_begin, vocab_size, smoothing,
                              num_threads, grad);
  } else if (logits.dtype == kBFloat16) {
    gradient_for_input<BFloat16>(logits, targets, lse, grad_loss, vocab_begin, vocab_size,
                                 smoothing, num_threads, grad);
  } else {
    gradient_for_input<Float16>(logits, targets, lse, grad_loss, vocab_begin, vocab_size,
                                smoothing, num_threads, grad);
  }
}

}  // namespace vpce::detail
