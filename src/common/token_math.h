// common/token_math.h: the per-token arithmetic shared by the CPU and CUDA kernels, so that
// both compute the same numbers from the same formulas: the loss constants, the merge of
// the ranks' statistics, one token's loss from merged statistics, and the constants of one
// token's gradient. Host and device code (VPCE_HD); fp64 wherever values are combined.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vpce/options.h"

#if defined(__CUDACC__)
#define VPCE_HD __host__ __device__
#else
#define VPCE_HD
#endif

namespace vpce::detail {

// The constants of the loss, derived once from the options and this rank's shard.
struct LossParams {
  int64_t vocab_size = 0;          // V
  int64_t valid_vocab = 0;         // Vv: columns [Vv, V) are padding
  double smoothing = 0.0;          // s: a Vv / (Vv - 1) (Megatron), a (PyTorch), a K / (K - 1) (legacy); 0 when off
  double smoothing_columns = 0.0;  // the classes s spreads over: Vv, or K (the shard's valid columns, legacy)
  // Megatron's legacy smoothing: the mean of logits is this shard's [shard_begin, shard_end).
  bool shard_smoothing = false;
  int64_t shard_begin = 0;
  int64_t shard_end = 0;
  double z_loss = 0.0;
  float logit_scale = 1.0f;
  float softcap = 0.0f;
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kNone;
  // The temperature T, applied last: z = transform(x) / T. One for every token, or token i's
  // at temperatures[i * temperature_stride] (host or device memory, as the logits) when given.
  float temperature = 1.0f;
  const float* temperatures = nullptr;
  int64_t temperature_stride = 0;
  // The backward has an entropy term (GradientConstants::entropy may be nonzero).
  bool entropy_gradient = false;

  VPCE_HD bool with_sum_logits() const { return smoothing != 0.0; }
  VPCE_HD bool ignored(int64_t target) const { return target == ignore_index; }
  VPCE_HD float temperature_of(int64_t i) const {
    return temperatures != nullptr ? temperatures[i * temperature_stride] : temperature;
  }
  // No temperature other than 1 on any token.
  VPCE_HD bool without_temperature() const { return temperatures == nullptr && temperature == 1.0f; }
};

// Row i's logit transform, z = transform(x) / T_i, as both backends apply it: without a cap,
// z = x scale (scale = logit_scale / T); with one, z = cap tanh(x scale inverse_cap) (cap =
// softcap / T, scale = logit_scale, inverse_cap = 1 / softcap), whose slope is
// slope_scale (1 - tanh^2) (slope_scale = logit_scale / T). (On the host, a row of
// per-token temperatures in device memory cannot be read: those rows only on the device.)
struct RowTransform {
  float scale = 1.0f;
  float cap = 0.0f;
  float inverse_cap = 0.0f;
  float slope_scale = 1.0f;
};
VPCE_HD inline RowTransform row_transform(const LossParams& p, int64_t row) {
  RowTransform t;
  const double temperature = p.without_temperature() ? 1.0 : static_cast<double>(p.temperature_of(row));
  const auto scaled = static_cast<float>(static_cast<double>(p.logit_scale) / temperature);
  if (p.softcap > 0.0f) {
    t.scale = p.logit_scale;
    t.cap = static_cast<float>(static_cast<double>(p.softcap) / temperature);
    t.inverse_cap = 1.0f / p.softcap;
    t.slope_scale = scaled;
  } else {
    t.scale = scaled;
    t.slope_scale = scaled;
  }
  return t;
}

// Whether T can be a temperature: finite, > 0, and not so small that row_transform's
// logit_scale / T (or, with a soft-cap, softcap / T) overflows fp32, which would turn every
// logit into +-inf or NaN. Both backends check each temperature with it.
VPCE_HD inline bool usable_temperature(float logit_scale, float softcap, float temperature) {
  if (!(temperature > 0.0f && temperature <= FLT_MAX)) return false;  // NaN, <= 0 or inf
  const auto t = static_cast<double>(temperature);
  const auto largest = static_cast<double>(FLT_MAX);
  return static_cast<double>(logit_scale) / t <= largest && static_cast<double>(softcap) / t <= largest;
}

// The columns of a shard [vocab_begin, vocab_begin + cols) that are real classes (not
// padding beyond Vv), counted from the shard's first column.
VPCE_HD inline int64_t valid_columns(int64_t vocab_begin, int64_t cols, const LossParams& p) {
  const int64_t valid = p.valid_vocab - vocab_begin;
  return valid < 0 ? 0 : valid > cols ? cols : valid;
}

inline LossParams loss_params(const LossOptions& options, const VocabShard& shard) {
  LossParams p;
  p.vocab_size = shard.vocab_size;
  p.valid_vocab = options.valid_vocab_size > 0 ? options.valid_vocab_size : shard.vocab_size;
  p.smoothing_columns = static_cast<double>(p.valid_vocab);
  if (options.smoothing_semantics == SmoothingSemantics::kMegatronLegacy) {
    p.shard_smoothing = true;
    p.shard_begin = shard.vocab_begin;
    p.shard_end = shard.vocab_end;
    p.smoothing_columns = static_cast<double>(valid_columns(shard.vocab_begin, shard.vocab_end - shard.vocab_begin, p));
  }
  const auto a = static_cast<double>(options.label_smoothing);
  const double k = p.smoothing_columns;
  if (a != 0.0) p.smoothing = options.smoothing_semantics == SmoothingSemantics::kPyTorch ? a : a * k / (k - 1.0);
  p.z_loss = static_cast<double>(options.z_loss_weight);
  p.logit_scale = options.logit_scale;
  p.softcap = options.softcap;
  p.ignore_index = options.ignore_index;
  p.reduction = options.reduction;
  return p;
}

// The columns whose mean of logits a rank's statistics (its shard [begin, end)) bring to the
// merge: its valid columns; with Megatron's legacy smoothing, only this rank's own shard's.
VPCE_HD inline int64_t merged_mean_columns(int64_t begin, int64_t end, const LossParams& p) {
  if (p.shard_smoothing && (begin != p.shard_begin || end != p.shard_end)) return 0;
  return valid_columns(begin, end - begin, p);
}

// The argmax column travels in a float slot of the statistics, bit for bit.
VPCE_HD inline float int_as_float_bits(int32_t value) {
  float out;
  memcpy(&out, &value, sizeof(out));
  return out;
}
VPCE_HD inline int32_t float_bits_as_int(float value) {
  int32_t out;
  memcpy(&out, &value, sizeof(out));
  return out;
}

// The logits' mean that label smoothing needs travels relative to the max it comes with:
// half the mean of z_v - ref(max) over the valid columns (0 for none), so that it stays small
// where the logits are large and close together (a plain fp32 sum of z over 20000 logits
// near 1e6 is off by 2^-24 of 2e10), and a mean rather than a sum, so that it stays in
// fp32's range where one logit is huge and the rest are not (the sum of 32000 offsets of
// -1e35 would not). ref(max) is the max, or 0 when the max is -inf (no column, or every one
// -inf: the mean is then that of z itself, 0 or -inf); a max of +inf or NaN makes it NaN,
// as mean z - max is there. Within a row the kernels keep the fp64 sum of z - ref(max) and
// rebase it as the max grows.
VPCE_HD inline double logit_reference(float max) { return max == -INFINITY ? 0.0 : static_cast<double>(max); }

// A sum of `columns` logits relative to ref(from), made relative to ref(to), in fp64.
VPCE_HD inline double rebased_logit_sum(double sum, int64_t columns, float from, float to) {
  if (columns == 0) return sum;
  return sum + static_cast<double>(columns) * (logit_reference(from) - logit_reference(to));
}

// What the statistics carry for `columns` logits whose sum relative to the reference is
// `sum`: half their mean, since any offset z - ref of two fp32 values halves into fp32's range
// (a row of 3e38 and -3e38 has offsets of -6e38). 0 for no column.
VPCE_HD inline float logit_half_mean(double sum, int64_t columns) {
  return columns == 0 ? 0.0f : static_cast<float>(sum / (2.0 * static_cast<double>(columns)));
}
// The mean from what the statistics carry.
VPCE_HD inline double logit_mean(float half_mean) { return 2.0 * static_cast<double>(half_mean); }

// How many valid columns each rank's statistics cover, for weighing their means of logits
// in the merge: columns[r] for rank r; or unknown (null), where only one rank's mean can be
// merged (it is the mean), and without label smoothing every mean is 0.
struct RankColumns {
  const int64_t* columns = nullptr;
  VPCE_HD bool known() const { return columns != nullptr; }
  VPCE_HD int64_t operator()(int r) const { return columns[r]; }
};

// The statistics' widths beyond options.h's: the RL outputs' with the sum of squared
// exponentials (for sum_v p_v^2), sum_v e^(2 (z_v - max)) at [6], [7] unused.
inline constexpr int64_t kStatsWidthWithSquares = 8;

// Merges `ranks` statistics rows (rank r's at first + r * rank_stride floats) into out[W],
// in rank order, in fp64: max, sum of exp relative to it, target logit, mean of the logits
// relative to it (the ranks' means weighed by the columns(r) they cover, each rebased to
// the merged max), with the extras (W >= 6) the smallest argmax column and the weighted
// offsets for the entropy, and with W = 8 the sum of squared exponentials.
template <class Columns>
VPCE_HD inline void merge_token(const float* first, int64_t rank_stride, int ranks, int64_t width,
                                const Columns& columns, float* out) {
  const bool with_extras = width >= kStatsWidthWithExtras;
  const bool with_squares = width == kStatsWidthWithSquares;
  const float neg_inf = -INFINITY;
  float max = neg_inf;
  float target_logit = neg_inf;
  for (int r = 0; r < ranks; ++r) {
    const float* s = first + r * rank_stride;
    max = s[0] > max ? s[0] : max;
    target_logit = s[2] > target_logit ? s[2] : target_logit;
  }
  double sum_exp = 0.0;
  double sum_logits = 0.0;  // sum z - ref(max), over `counted` columns
  int64_t counted = 0;
  double weighted_offsets = 0.0;
  double squares = 0.0;  // sum exp(2 (z - M))
  int32_t argmax = -1;
  for (int r = 0; r < ranks; ++r) {
    const float* s = first + r * rank_stride;
    if (columns.known() && columns(r) > 0) {
      sum_logits += rebased_logit_sum(logit_mean(s[3]) * static_cast<double>(columns(r)), columns(r), s[0], max);
      counted += columns(r);
    }
    // An all -inf shard adds nothing (and -inf - -inf is NaN); one whose max is -inf but
    // whose sum is NaN holds NaN logits, and its NaN must reach the loss.
    if (s[0] == neg_inf && s[1] == s[1]) continue;  // s[1] == s[1]: not NaN
    const double shift = static_cast<double>(s[0]) - static_cast<double>(max);
    const double scale = exp(shift);
    sum_exp += static_cast<double>(s[1]) * scale;
    if (with_extras) {
      // sum exp(z - M)(z - M) = e^shift (sum exp(z - m)(z - m) + shift sum exp(z - m))
      weighted_offsets += scale * (static_cast<double>(s[5]) + shift * static_cast<double>(s[1]));
      if (with_squares) squares += scale * scale * static_cast<double>(s[6]);
      const int32_t index = float_bits_as_int(s[4]);
      if (s[0] == max && index >= 0 && (argmax < 0 || index < argmax)) argmax = index;
    }
  }
  out[0] = max;
  out[1] = static_cast<float>(sum_exp);
  out[2] = target_logit;
  out[3] = columns.known() ? logit_half_mean(sum_logits, counted) : ranks == 1 ? first[3] : 0.0f;
  if (with_extras) {
    out[4] = int_as_float_bits(argmax);
    out[5] = static_cast<float>(weighted_offsets);
  }
  if (with_squares) {
    out[6] = static_cast<float>(squares);
    out[7] = 0.0f;
  }
}

// One token's results from its merged statistics `st`.
struct TokenLoss {
  double weighted_loss = 0.0;     // weight x loss; 0 when the token is not counted
  double lse = 0.0;               // max + log(sum) in fp64 (its rounding 2^-53 |lse|; LseTokens)
  float entropy = 0.0f;           // with the extras
  float target_is_argmax = 0.0f;  // with the extras; 0 when not counted
};

VPCE_HD inline TokenLoss token_loss(const float* st, int64_t target, double weight, const LossParams& p,
                                    bool with_extras) {
  TokenLoss out;
  const auto max = static_cast<double>(st[0]);
  const auto sum_exp = static_cast<double>(st[1]);
  const double log_sum = log(sum_exp);
  const double lse = max + log_sum;
  out.lse = lse;
  const bool counted = !p.ignored(target) && weight != 0.0;
  // The loss's terms and the entropy are >= 0; the sums' roundings can take a very confident
  // token's a rounding below 0 (a sum of 1 - 2^-24 where it is 1 + 1e-9), which is 0's
  // nearer neighbour. (at_least_zero keeps a NaN.)
  const auto at_least_zero = [](double x) { return x < 0.0 ? 0.0 : x; };
  if (with_extras) {
    out.entropy = static_cast<float>(at_least_zero(log_sum - static_cast<double>(st[5]) / sum_exp));
    out.target_is_argmax = counted && float_bits_as_int(st[4]) == target ? 1.0f : 0.0f;
  }
  if (!counted) return out;
  // lse - z_target as (max - z_target) + log(sum): exact subtraction of nearby values.
  const double nll = at_least_zero((max - static_cast<double>(st[2])) + log_sum);
  double loss = nll;
  const double s = p.smoothing;
  // lse - mean z = (max - ref(max)) - mean (z - ref(max)) + log(sum); the first term is 0
  // unless max is -inf, +inf or NaN.
  if (s != 0.0) {
    const double uniform = at_least_zero(((max - logit_reference(st[0])) - logit_mean(st[3])) + log_sum);
    // s = 1 (PyTorch's semantics take it) leaves no target term: 0 x nll would be NaN for an
    // infinite nll, where the loss is the uniform term's (+inf then too).
    loss = s == 1.0 ? uniform : (1.0 - s) * nll + s * uniform;
  }
  if (p.z_loss != 0.0) loss += p.z_loss * lse * lse;
  out.weighted_loss = weight * loss;
  return out;
}

// The constants of one token's gradient:
//   grad_v = [upstream (exp(z_v - lse) coefficient - uniform [- target_weight at the target])
//             + entropy exp(z_v - lse) (z_v - mean_logit)] dz/dx_v
// (the entropy term is the RL outputs' (src/rl/): -g_H p_v (z_v - E_p[z]), 0 for the loss).
// The device kernels take exp(z_v - lse) as exp(z_v - lse32) e^(lse32 - lse), lse32 the lse
// rounded to fp32: the fp32 subtraction is exact for the terms that count, and the factor,
// |lse32 - lse| <= min(ulp(lse) / 2, log Vv), rides in the coefficient. So an lse kept in
// fp64 gives p to fp32's rounding up to |lse| of about 1e9 (the double's own 2^-53 |lse|
// beyond); one kept in fp32 has lost 2^-24 |lse| already (the factor is then 1). The CPU's
// kernels shift each block by its own max m instead, exp(z_v - m) e^(m - lse), from the fp64
// members (the argument's rounding is then 2^-24 |z_v - m|, no larger than in Megatron's
// exp(z - max), where |z_v - lse32| exceeds it by up to log Vv).
struct GradientConstants {
  float upstream;                 // g_i w_i (0 for an ignored token)
  float lse;                      // lse32
  float coefficient;              // (1 + 2 zl lse) e^(lse32 - lse)
  float uniform;                  // s / Vv (s / K with the legacy smoothing)
  double exact_upstream;          // g_i w_i
  double exact_lse;               // the lse as the forward kept it
  double z_loss_factor;           // 1 + 2 zl lse
  double exact_uniform;           // s / Vv
  float entropy = 0.0f;           // -g_H e^(lse32 - lse)
  float mean_logit = 0.0f;        // E_p[z] as two floats, mean_logit + mean_logit_low: the
  float mean_logit_low = 0.0f;    // rounding of one would cost 2^-24 |z| of z - E_p[z]
  double exact_entropy = 0.0;     // -g_H
  double exact_mean_logit = 0.0;  // E_p[z], as the forward kept it

  // Every element of the row is 0 (an ignored token, or one whose upstream gradients are 0).
  VPCE_HD bool zero_row() const { return upstream == 0.0f && entropy == 0.0f; }
};

// The entropy's term of one element, e (z - mean) for e = exp(z - lse): 0 where e is 0 (also
// for z = -inf, where z - mean is -inf); z - mean is above -117 wherever e is not 0 in fp32.
VPCE_HD inline double entropy_term(double e, double z, double mean) { return e == 0.0 ? 0.0 : e * (z - mean); }

// z - E_p[z] in fp32 for the kernels: z - hi exact where z is near it, then - lo; held above
// -2^64 so that a column of -inf (whose exponential is 0) gives 0 x -2^64 = 0, not NaN. (The
// SIMD kernels take the same three operations on vectors.)
inline constexpr float kLowestEntropyOffset = -0x1p64f;
VPCE_HD inline float entropy_offset(float z, const GradientConstants& c) {
  const float offset = (z - c.mean_logit) - c.mean_logit_low;
  return offset > kLowestEntropyOffset ? offset : kLowestEntropyOffset;
}

// The constants from their fp64 values: upstream g_i w_i, the lse, 1 + 2 zl lse, s / Vv.
VPCE_HD inline GradientConstants make_gradient_constants(double upstream, double lse, double z_loss_factor,
                                                         double uniform, double entropy = 0.0,
                                                         double mean_logit = 0.0) {
  const auto lse32 = static_cast<float>(lse);
  const double residual = static_cast<double>(lse32) - lse;
  // (An lse of +-inf or NaN leaves a NaN residual: no factor.)
  const double factor = residual == 0.0 || !(residual - residual == 0.0) ? 1.0 : exp(residual);
  const auto mean_high = static_cast<float>(mean_logit);
  return GradientConstants{static_cast<float>(upstream),
                           lse32,
                           static_cast<float>(z_loss_factor * factor),
                           static_cast<float>(uniform),
                           upstream,
                           lse,
                           z_loss_factor,
                           uniform,
                           static_cast<float>(entropy * factor),
                           mean_high,
                           static_cast<float>(mean_logit - static_cast<double>(mean_high)),
                           entropy,
                           mean_logit};
}

VPCE_HD inline GradientConstants gradient_constants(int64_t target, double upstream, float weight, double token_lse,
                                                    const LossParams& p) {
  return make_gradient_constants(p.ignored(target) ? 0.0 : upstream * static_cast<double>(weight), token_lse,
                                 1.0 + 2.0 * p.z_loss * token_lse, p.smoothing / p.smoothing_columns);
}

// A token's lse as the forward stored it, float32 or float64 (host and device).
struct LseTokens {
  char* base = nullptr;
  int64_t stride = 0;
  bool fp64 = false;
  VPCE_HD double get(int64_t i) const {
    return fp64 ? reinterpret_cast<const double*>(base)[i * stride]
                : static_cast<double>(reinterpret_cast<const float*>(base)[i * stride]);
  }
  VPCE_HD void set(int64_t i, double v) const {
    if (fp64) {
      reinterpret_cast<double*>(base)[i * stride] = v;
    } else {
      reinterpret_cast<float*>(base)[i * stride] = static_cast<float>(v);
    }
  }
};

// The weight of the one-hot target term: 1 - s.
VPCE_HD inline float target_weight(const LossParams& p) { return static_cast<float>(1.0 - p.smoothing); }

// ---- the RL outputs (src/rl/) ----------------------------------------------------------------

// One token's log-probability of its token y and the entropy of softmax(z), from its merged
// statistics with the extras (max M, S = sum e^(z - M), z_y, U = sum e^(z - M) (z - M)), and
// what the backward keeps: lse = M + log S and E_p[z] = M + U / S.
struct TokenPolicy {
  double log_prob = 0.0;  // z_y - lse = -((M - z_y) + log S), at most 0; 0 for an ignored token
  double entropy = 0.0;   // log S - U / S (the shifted form: no cancellation), at least 0; 0 ignored
  double lse = 0.0;
  double mean_logit = 0.0;     // E_p[z]
  double sum_p_squared = 0.0;  // sum_v p_v^2 = S2 / S^2 (W = 8: S2 at [6]); 0 for an ignored token
};

VPCE_HD inline TokenPolicy token_policy(const float* st, int64_t token, const LossParams& p,
                                        bool with_squares = false) {
  TokenPolicy out;
  const auto max = static_cast<double>(st[0]);
  const auto sum_exp = static_cast<double>(st[1]);
  const double log_sum = log(sum_exp);
  const double mean_offset = static_cast<double>(st[5]) / sum_exp;
  out.lse = max + log_sum;
  out.mean_logit = max + mean_offset;
  if (p.ignored(token)) return out;
  // The sums' roundings can take a certain token's log-probability a rounding above 0 and its
  // entropy one below (both keep a NaN).
  const double log_prob = -((max - static_cast<double>(st[2])) + log_sum);
  out.log_prob = log_prob > 0.0 ? 0.0 : log_prob;
  const double entropy = log_sum - mean_offset;
  out.entropy = entropy < 0.0 ? 0.0 : entropy;
  if (with_squares) out.sum_p_squared = static_cast<double>(st[6]) / (sum_exp * sum_exp);
  return out;
}

// The constants of one token's gradient of g_lp log p_y + g_H H: the loss's with the upstream
// -g_lp (d log p_y / dz_v = 1[v = y] - p_v) and the entropy term -g_H p_v (z_v - E_p[z])
// (dH / dz_v); none for an ignored token.
VPCE_HD inline GradientConstants policy_gradient_constants(int64_t token, double grad_log_prob, double grad_entropy,
                                                           double lse, double mean_logit, const LossParams& p) {
  if (p.ignored(token)) return make_gradient_constants(0.0, lse, 1.0, 0.0);
  return make_gradient_constants(-grad_log_prob, lse, 1.0, 0.0, -grad_entropy, mean_logit);
}

}  // namespace vpce::detail
