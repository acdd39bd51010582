// reference/reference.cc: the fp64 oracle (see reference.h).
//
//   lse  = log sum_v exp(z_v)                    (computed as m + log sum exp(z_v - m))
//   s    = a V / (V - 1)                          (Megatron's label smoothing, global V)
//   loss = (1 - s)(lse - z_y) + s (lse - mean_v z_v)
//   grad = g (p_v - (1 - s)[v == y] - s / V),    p_v = exp(z_v - lse)
#include "reference.h"

#include <cmath>
#include <limits>

namespace vpce::reference {
namespace {

double log_sum_exp(const double* row, int64_t v) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < v; ++j) m = std::max(m, row[j]);
  double sum = 0.0;
  for (int64_t j = 0; j < v; ++j) sum += std::exp(row[j] - m);
  return m + std::log(sum);
}

double smoothing_weight(double label_smoothing, int64_t v) {
  return label_smoothing == 0.0 ? 0.0 : label_smoothing * static_cast<double>(v) / (v - 1.0);
}

}  // namespace

double token_loss(const double* row, int64_t v, int64_t target, double label_smoothing) {
  const double lse = log_sum_exp(row, v);
  const double s = smoothing_weight(label_smoothing, v);
  double loss = lse - row[target];
  if (s != 0.0) {
    double mean = 0.0;
    for (int64_t j = 0; j < v; ++j) mean += row[j];
    mean /= static_cast<double>(v);
    loss = (1.0 - s) * loss + s * (lse - mean);
  }
  return loss;
}

Result cross_entropy(const std::vector<double>& logits, int64_t n, int64_t v,
                     const std::vector<int64_t>& targets, double label_smoothing,
                     const std::vector<double>& grad_loss) {
  Result out;
  out.loss.resize(static_cast<size_t>(n));
  out.lse.resize(static_cast<size_t>(n));
  out.grad.resize(static_cast<size_t>(n * v));
  const double s = smoothing_weight(label_smoothing, v);
  for (int64_t i = 0; i < n; ++i) {
    const double* row = logits.data() + i * v;
    const double lse = log_sum_exp(row, v);
    const double g = grad_loss.empty() ? 1.0 : grad_loss[static_cast<size_t>(i)];
    out.lse[static_cast<size_t>(i)] = lse;
    out.loss[static_cast<size_t>(i)] = token_loss(row, v, targets[static_cast<size_t>(i)],
                                                  label_smoothing);
    for (int64_t j = 0; j < v; ++j) {
      const double target = j == targets[static_cast<size_t>(i)] ? 1.0 - s : 0.0;
      out.grad[static_cast<size_t>(i * v + j)] = g * (std::exp(row[j] - lse) - target - s / v);
    }
  }
  return out;
}

}  // namespace vpce::reference
