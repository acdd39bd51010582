// cpu/kernels.cc: portable C++ kernels of the four stages (see kernels.h).
//
// One token's row is handled by one thread: the max (and its first index) over the row,
// then the sums of exp(z - max) (fp32 exp, fp64 accumulation) while the row is still in
// cache; the gradient reads each logit once and writes each gradient element once. The
// logit transform (scale, soft-cap) is a template parameter, so the plain case pays
// nothing for it.
#include "kernels.h"

#include <bit>
#include <cmath>
#include <limits>

#include "dtype.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace vpce::detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// ---- the logit transform: z = f(x), and dz/dx --------------------------------------------

struct Identity {
  float operator()(float x) const { return x; }
  static constexpr bool kHasSlope = false;
  float slope(float) const { return 1.0f; }
};

struct Scaled {
  float scale;
  float operator()(float x) const { return x * scale; }
  static constexpr bool kHasSlope = true;
  float slope(float) const { return scale; }
};

struct SoftCapped {
  float scale;
  float cap;
  float inverse_cap;
  float operator()(float x) const { return cap * std::tanh(x * scale * inverse_cap); }
  static constexpr bool kHasSlope = true;
  float slope(float z) const {
    const float t = z * inverse_cap;
    return scale * (1.0f - t * t);
  }
};

// Calls fn(transform) with the transform the params ask for.
template <class Fn>
void with_transform(const LossParams& p, const Fn& fn) {
  if (p.softcap > 0.0f) {
    fn(SoftCapped{p.logit_scale, p.softcap, 1.0f / p.softcap});
  } else if (p.logit_scale != 1.0f) {
    fn(Scaled{p.logit_scale});
  } else {
    fn(Identity{});
  }
}

// Calls fn(T{}) with the storage type of `dtype` (fp32, bf16 or fp16).
template <class Fn>
void with_storage(DataType dtype, const Fn& fn) {
  if (dtype == kFloat32) {
    fn(float{});
  } else if (dtype == kBFloat16) {
    fn(BFloat16{});
  } else {
    fn(Float16{});
  }
}

// The columns of [vocab_begin, vocab_begin + cols) that are real classes, counted from 0.
int64_t valid_columns(int64_t vocab_begin, int64_t cols, const LossParams& p) {
  const int64_t valid = p.valid_vocab - vocab_begin;
  return valid < 0 ? 0 : valid > cols ? cols : valid;
}

// ---- stage 1: local statistics ---------------------------------------------------------

// row: [cols] of T -> out[0..W) (TokenStats, then TokenStatsExtras when W = 6).
template <class T, class Transform>
void row_stats(const T* row, int64_t cols, int64_t target_col, int64_t vocab_begin,
               bool with_sum_logits, bool with_extras, Transform f, float* out) {
  float max = kNegInf;
  int64_t argmax = -1;
  for (int64_t v = 0; v < cols; ++v) {
    const float z = f(to_float(row[v]));
    if (z > max) {
      max = z;
      argmax = v;
    }
  }
  double sum_exp = 0.0;
  double sum_logits = 0.0;
  double weighted_offsets = 0.0;
  if (max != kNegInf) {
    for (int64_t v = 0; v < cols; ++v) {
      const float z = f(to_float(row[v]));
      const float offset = z - max;
      const float e = std::exp(offset);
      sum_exp += static_cast<double>(e);
      sum_logits += static_cast<double>(z);
      if (e > 0.0f) weighted_offsets += static_cast<double>(e) * static_cast<double>(offset);
    }
  } else if (cols > 0) {
    sum_logits = -std::numeric_limits<double>::infinity();  // every column is -inf
  }
  const bool owns_target = target_col >= 0 && target_col < cols;
  out[0] = max;
  out[1] = static_cast<float>(sum_exp);
  out[2] = owns_target ? f(to_float(row[target_col])) : kNegInf;
  out[3] = with_sum_logits ? static_cast<float>(sum_logits) : 0.0f;
  if (with_extras) {
    const int32_t global = argmax < 0 ? -1 : static_cast<int32_t>(argmax + vocab_begin);
    out[4] = std::bit_cast<float>(global);
    out[5] = static_cast<float>(weighted_offsets);
  }
}

// ---- stage 4: gradient -------------------------------------------------------------------

struct RowGradient {
  float upstream;       // g_i w_i (0: the row is all zeros)
  float lse;
  float coefficient;    // 1 + 2 zl lse
  float uniform;        // s / Vv
  float target_weight;  // 1 - s
};

// row: [cols] of T -> grad row [cols] of G, columns [valid, cols) padding; the row may be
// the grad row itself, so the target's logit is read before anything is written.
template <class T, class G, class Transform>
void row_gradient(const T* row, G* grad, int64_t cols, int64_t valid, int64_t target_col,
                  const RowGradient& r, Transform f) {
  if (r.upstream == 0.0f) {
    for (int64_t v = 0; v < cols; ++v) grad[v] = from_float<G>(0.0f);
    return;
  }
  const bool owns_target = target_col >= 0 && target_col < valid;
  const float target_x = owns_target ? to_float(row[target_col]) : 0.0f;
  auto element = [&](float x, float target_term) {
    const float z = f(x);
    const float p = std::exp(z - r.lse);
    float d = r.upstream * ((p * r.coefficient - r.uniform) - target_term);
    if constexpr (Transform::kHasSlope) d *= f.slope(z);
    return d;
  };
  for (int64_t v = 0; v < valid; ++v) grad[v] = from_float<G>(element(to_float(row[v]), 0.0f));
  for (int64_t v = valid; v < cols; ++v) grad[v] = from_float<G>(0.0f);
  if (owns_target) grad[target_col] = from_float<G>(element(target_x, r.target_weight));
}

float weight_at(const TokenVector& weights, int64_t i) {
  return present(weights) ? weights.at<float>(i) : 1.0f;
}

}  // namespace

LossParams loss_params(const LossOptions& options, int64_t vocab_size) {
  LossParams p;
  p.vocab_size = vocab_size;
  p.valid_vocab = options.valid_vocab_size > 0 ? options.valid_vocab_size : vocab_size;
  const auto a = static_cast<double>(options.label_smoothing);
  const auto vv = static_cast<double>(p.valid_vocab);
  if (a != 0.0) {
    p.smoothing = options.smoothing_semantics == SmoothingSemantics::kPyTorch ? a : a * vv / (vv - 1.0);
  }
  p.z_loss = static_cast<double>(options.z_loss_weight);
  p.logit_scale = options.logit_scale;
  p.softcap = options.softcap;
  p.ignore_index = options.ignore_index;
  p.reduction = options.reduction;
  return p;
}

int64_t target_at(const TokenVector& targets, int64_t i) {
  return targets.dtype == kInt64 ? targets.at<int64_t>(i) : targets.at<int32_t>(i);
}

void local_stats_kernel(const RowMatrix& logits, const TokenVector& targets, int64_t vocab_begin,
                        const LossParams& params, int num_threads, const RowMatrix& stats) {
  const int64_t valid = valid_columns(vocab_begin, logits.cols, params);
  const bool with_extras = stats.cols == kStatsWidthWithExtras;
  with_storage(logits.dtype, [&](auto storage) {
    using T = decltype(storage);
    with_transform(params, [&](auto transform) {
      parallel_rows(logits.rows, num_threads, [&](int64_t i) {
        row_stats(logits.row<const T>(i), valid, target_at(targets, i) - vocab_begin, vocab_begin,
                  params.with_sum_logits(), with_extras, transform, stats.row<float>(i));
      });
    });
  });
}

void merge_stats_kernel(const float* gathered_base, int64_t rank_stride, int ranks,
                        int64_t row_stride, int num_threads, const RowMatrix& stats) {
  const bool with_extras = stats.cols == kStatsWidthWithExtras;
  parallel_rows(stats.rows, num_threads, [&](int64_t i) {
    auto part = [&](int r) { return gathered_base + r * rank_stride + i * row_stride; };
    float max = kNegInf;
    float target_logit = kNegInf;
    for (int r = 0; r < ranks; ++r) {
      max = part(r)[0] > max ? part(r)[0] : max;
      target_logit = part(r)[2] > target_logit ? part(r)[2] : target_logit;
    }
    double sum_exp = 0.0;
    double sum_logits = 0.0;
    double weighted_offsets = 0.0;
    int32_t argmax = -1;
    for (int r = 0; r < ranks; ++r) {
      const float* s = part(r);
      sum_logits += static_cast<double>(s[3]);
      if (s[0] == kNegInf) continue;  // an all -inf shard adds nothing (and -inf - -inf is NaN)
      const double shift = static_cast<double>(s[0]) - static_cast<double>(max);
      const double scale = std::exp(shift);
      sum_exp += static_cast<double>(s[1]) * scale;
      if (with_extras) {
        // sum exp(z - M)(z - M) = e^shift (sum exp(z - m)(z - m) + shift sum exp(z - m))
        weighted_offsets += scale * (static_cast<double>(s[5]) + shift * static_cast<double>(s[1]));
        const auto index = std::bit_cast<int32_t>(s[4]);
        if (s[0] == max && index >= 0 && (argmax < 0 || index < argmax)) argmax = index;
      }
    }
    float* out = stats.row<float>(i);
    out[0] = max;
    out[1] = static_cast<float>(sum_exp);
    out[2] = target_logit;
    out[3] = static_cast<float>(sum_logits);
    if (with_extras) {
      out[4] = std::bit_cast<float>(argmax);
      out[5] = static_cast<float>(weighted_offsets);
    }
  });
}

void loss_kernel(const RowMatrix& stats, const TokenVector& targets, const TokenVector& weights,
                 const LossParams& params, int num_threads, const LossOutputs& out) {
  const double s = params.smoothing;
  const auto vv = static_cast<double>(params.valid_vocab);
  // Token i's weighted loss, and the per-token outputs other than the loss.
  auto token = [&](int64_t i) {
    const float* st = stats.row<float>(i);
    const auto max = static_cast<double>(st[0]);
    const auto sum_exp = static_cast<double>(st[1]);
    const double log_sum = std::log(sum_exp);
    const double lse = max + log_sum;
    out.lse.at<float>(i) = static_cast<float>(lse);
    const int64_t y = target_at(targets, i);
    const double weight = weight_at(weights, i);
    const bool counted = !params.ignored(y) && weight != 0.0;
    if (present(out.entropy)) {
      out.entropy.at<float>(i) = static_cast<float>(log_sum - static_cast<double>(st[5]) / sum_exp);
    }
    if (present(out.target_is_argmax)) {
      out.target_is_argmax.at<float>(i) = counted && std::bit_cast<int32_t>(st[4]) == y ? 1.0f : 0.0f;
    }
    if (!counted) return 0.0;
    // lse - z_target as (max - z_target) + log(sum): exact subtraction of nearby values.
    const double nll = (max - static_cast<double>(st[2])) + log_sum;
    double loss = nll;
    if (s != 0.0) loss = (1.0 - s) * nll + s * ((max - static_cast<double>(st[3]) / vv) + log_sum);
    if (params.z_loss != 0.0) loss += params.z_loss * lse * lse;
    return weight * loss;
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

double counted_weight(const TokenVector& targets, const TokenVector& weights,
                      const LossParams& params) {
  double total = 0.0;
  for (int64_t i = 0; i < targets.n; ++i) {
    if (!params.ignored(target_at(targets, i))) total += static_cast<double>(weight_at(weights, i));
  }
  return total;
}

void gradient_kernel(const RowMatrix& logits, const TokenVector& targets,
                     const TokenVector& weights, const TokenVector& lse,
                     const TokenVector& grad_loss, int64_t vocab_begin,
                     const LossParams& params, int num_threads, const RowMatrix& grad) {
  const int64_t valid = valid_columns(vocab_begin, logits.cols, params);
  // The upstream gradient of each token: per token for kNone; the scalar, divided by the
  // counted weight for kMean, otherwise.
  double shared_upstream = 0.0;
  if (params.reduction != Reduction::kNone) {
    shared_upstream = static_cast<double>(grad_loss.at<float>(0));
    if (params.reduction == Reduction::kMean) {
      const double denominator = counted_weight(targets, weights, params);
      shared_upstream = denominator != 0.0 ? shared_upstream / denominator : 0.0;
    }
  }
  const auto uniform = static_cast<float>(params.smoothing / static_cast<double>(params.valid_vocab));
  const auto target_weight = static_cast<float>(1.0 - params.smoothing);
  with_storage(logits.dtype, [&](auto storage) {
    using T = decltype(storage);
    with_storage(grad.dtype, [&](auto grad_storage) {
      using G = decltype(grad_storage);
      with_transform(params, [&](auto transform) {
        parallel_rows(logits.rows, num_threads, [&](int64_t i) {
          const int64_t y = target_at(targets, i);
          const double upstream = params.reduction == Reduction::kNone
                                      ? static_cast<double>(grad_loss.at<float>(i))
                                      : shared_upstream;
          const float token_lse = lse.at<float>(i);
          const RowGradient r{
              params.ignored(y) ? 0.0f : static_cast<float>(upstream * static_cast<double>(weight_at(weights, i))),
              token_lse, static_cast<float>(1.0 + 2.0 * params.z_loss * static_cast<double>(token_lse)),
              uniform, target_weight};
          row_gradient(logits.row<const T>(i), grad.row<G>(i), logits.cols, valid, y - vocab_begin, r,
                       transform);
        });
      });
    });
  });
}

}  // namespace vpce::detail
