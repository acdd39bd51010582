// reference/reference.cc: the fp64 oracle (see reference.h).
#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace vpce::reference {
namespace {

int64_t valid_columns(const Options& o, int64_t v) { return o.valid_vocab > 0 ? o.valid_vocab : v; }

double transform(double x, const Options& o) {
  const double z = x * o.logit_scale;
  return o.softcap > 0.0 ? o.softcap * std::tanh(z / o.softcap) : z;
}

// dz/dx at z.
double slope(double z, const Options& o) {
  if (o.softcap <= 0.0) return o.logit_scale;
  const double t = z / o.softcap;
  return o.logit_scale * (1.0 - t * t);
}

// The transformed valid logits of one row.
std::vector<double> transformed(const double* row, int64_t v, const Options& o) {
  std::vector<double> z(static_cast<size_t>(valid_columns(o, v)));
  for (size_t j = 0; j < z.size(); ++j) z[j] = transform(row[j], o);
  return z;
}

double log_sum_exp(const std::vector<double>& z) {
  double m = -std::numeric_limits<double>::infinity();
  for (double x : z) {
    if (std::isnan(x)) return x;
    m = std::max(m, x);
  }
  if (m == -std::numeric_limits<double>::infinity()) return m;  // log 0: no mass
  double sum = 0.0;
  for (double x : z) sum += std::exp(x - m);
  return m + std::log(sum);
}

// The target distribution q over the valid columns.
std::vector<double> target_distribution(size_t columns, int64_t target, const Options& o) {
  const double a = o.label_smoothing;
  if (o.smoothing_end > o.smoothing_begin) {
    const auto begin = static_cast<size_t>(o.smoothing_begin);
    const size_t end = std::min(static_cast<size_t>(o.smoothing_end), columns);
    const auto k = static_cast<double>(end - begin);
    const double s = a > 0.0 ? a * k / (k - 1.0) : 0.0;
    std::vector<double> q(columns, 0.0);
    for (size_t j = begin; j < end; ++j) q[j] = s / k;
    q[static_cast<size_t>(target)] += 1.0 - s;
    return q;
  }
  const auto vv = static_cast<double>(columns);
  std::vector<double> q(columns, o.pytorch_smoothing ? a / vv : (a > 0.0 ? a / (vv - 1.0) : 0.0));
  q[static_cast<size_t>(target)] = o.pytorch_smoothing ? 1.0 - a + a / vv : 1.0 - a;
  return q;
}

double loss_of(const std::vector<double>& z, double lse, int64_t target, const Options& o) {
  const std::vector<double> q = target_distribution(z.size(), target, o);
  double loss = 0.0;
  for (size_t j = 0; j < z.size(); ++j) {
    if (q[j] != 0.0) loss -= q[j] * (z[j] - lse);
  }
  return loss + o.z_loss * lse * lse;
}

}  // namespace

double token_loss(const double* row, int64_t v, int64_t target, const Options& options) {
  const std::vector<double> z = transformed(row, v, options);
  return loss_of(z, log_sum_exp(z), target, options);
}

Result cross_entropy(const std::vector<double>& logits, int64_t n, int64_t v, const std::vector<int64_t>& targets,
                     const std::vector<double>& weights, const std::vector<double>& grad_loss, const Options& options) {
  Result out;
  const auto un = static_cast<size_t>(n);
  out.lse.resize(un);
  out.grad.assign(un * static_cast<size_t>(v), 0.0);
  out.target_is_argmax.resize(un);
  out.entropy.resize(un);
  out.top_gap.resize(un);
  std::vector<double> per_token(un, 0.0);
  double counted_weight = 0.0;
  for (size_t i = 0; i < un; ++i) {
    const bool ignored = targets[i] == options.ignore_index;
    const double w = weights.empty() ? 1.0 : weights[i];
    if (!ignored) counted_weight += w;
  }
  for (size_t i = 0; i < un; ++i) {
    const double* row = logits.data() + i * static_cast<size_t>(v);
    const std::vector<double> z = transformed(row, v, options);
    const double lse = log_sum_exp(z);
    out.lse[i] = lse;
    double entropy = 0.0;
    size_t best = 0;
    for (size_t j = 0; j < z.size(); ++j) {
      const double p = std::exp(z[j] - lse);
      if (p != 0.0) entropy -= p * (z[j] - lse);  // 0 log 0 = 0; NaN stays NaN
      if (z[j] > z[best]) best = j;
    }
    double second = -std::numeric_limits<double>::infinity();
    for (size_t j = 0; j < z.size(); ++j) {
      if (j != best) second = std::max(second, z[j]);
    }
    out.entropy[i] = entropy;
    out.top_gap[i] = z[best] - second;
    const bool ignored = targets[i] == options.ignore_index;
    const double w = weights.empty() ? 1.0 : weights[i];
    out.target_is_argmax[i] = !ignored && w != 0.0 && static_cast<int64_t>(best) == targets[i] ? 1.0 : 0.0;
    if (ignored || w == 0.0) continue;
    per_token[i] = w * loss_of(z, lse, targets[i], options);
    double g = grad_loss.empty() ? 1.0 : grad_loss[options.reduction == Reduction::kNone ? i : 0];
    if (options.reduction == Reduction::kMean) g = counted_weight != 0.0 ? g / counted_weight : 0.0;
    const std::vector<double> q = target_distribution(z.size(), targets[i], options);
    for (size_t j = 0; j < z.size(); ++j) {
      const double p = std::exp(z[j] - lse);
      out.grad[i * static_cast<size_t>(v) + j] =
          g * w * (p * (1.0 + 2.0 * options.z_loss * lse) - q[j]) * slope(z[j], options);
    }
  }
  if (options.reduction == Reduction::kNone) {
    out.loss = per_token;
  } else {
    double total = 0.0;
    for (double l : per_token) total += l;
    if (options.reduction == Reduction::kMean) total = counted_weight != 0.0 ? total / counted_weight : 0.0;
    out.loss = {total};
  }
  return out;
}

Result cross_entropy(const std::vector<double>& logits, int64_t n, int64_t v, const std::vector<int64_t>& targets,
                     double label_smoothing, const std::vector<double>& grad_loss) {
  Options options;
  options.label_smoothing = label_smoothing;
  return cross_entropy(logits, n, v, targets, {}, grad_loss, options);
}

PolicyResult policy(const std::vector<double>& logits, int64_t n, int64_t v, const std::vector<int64_t>& tokens,
                    const std::vector<double>& temperatures, const std::vector<double>& grad_log_prob,
                    const std::vector<double>& grad_entropy, const Options& options) {
  PolicyResult out;
  out.log_prob.assign(static_cast<size_t>(n), 0.0);
  out.entropy.assign(static_cast<size_t>(n), 0.0);
  out.sum_p_squared.assign(static_cast<size_t>(n), 0.0);
  out.grad.assign(static_cast<size_t>(n * v), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const auto row = static_cast<size_t>(i);
    if (tokens[row] == options.ignore_index) continue;
    const double temperature = temperatures.empty() ? 1.0 : temperatures[row];
    std::vector<double> z = transformed(&logits[row * static_cast<size_t>(v)], v, options);
    for (double& value : z) value /= temperature;
    const double lse = log_sum_exp(z);
    double entropy = 0.0;
    std::vector<double> log_p(z.size());
    for (size_t j = 0; j < z.size(); ++j) {
      log_p[j] = z[j] - lse;
      const double p = std::exp(log_p[j]);
      if (p != 0.0 || std::isnan(p)) entropy -= p * log_p[j];
      out.sum_p_squared[row] += p * p;
    }
    out.log_prob[row] = log_p[static_cast<size_t>(tokens[row])];
    out.entropy[row] = entropy;
    const double g_lp = grad_log_prob.empty() ? 0.0 : grad_log_prob[row];
    const double g_h = grad_entropy.empty() ? 0.0 : grad_entropy[row];
    for (size_t j = 0; j < z.size(); ++j) {
      const double p = std::exp(log_p[j]);
      const double onehot = static_cast<int64_t>(j) == tokens[row] ? 1.0 : 0.0;
      const double d_entropy = p == 0.0 ? 0.0 : -p * (log_p[j] + entropy);
      const double dz = g_lp * (onehot - p) + g_h * d_entropy;
      const double x = logits[row * static_cast<size_t>(v) + j];
      out.grad[row * static_cast<size_t>(v) + j] = dz * slope(transform(x, options), options) / temperature;
    }
  }
  return out;
}

}  // namespace vpce::reference
