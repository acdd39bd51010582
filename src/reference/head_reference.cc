// reference/head_reference.cc: the fused head's fp64 oracle (head_reference.h).
#include "reference/head_reference.h"

#include <bit>
#include <cmath>
#include <cstddef>

namespace vpce::reference {
namespace {

// x rounded to fp32, then to bf16 to nearest even (NaN kept), read back as a double.
double bf16_of(double x) {
  const auto f = static_cast<float>(x);
  if (std::isnan(f)) return x;
  uint32_t bits = std::bit_cast<uint32_t>(f);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return std::bit_cast<float>(bits & 0xffff0000u);
}

// x rounded to `bits` significant bits, to nearest even (0: x itself); normal range only.
double rounded(double x, int bits) {
  if (bits == 0 || x == 0.0 || !std::isfinite(x)) return x;
  int exponent = 0;
  std::frexp(x, &exponent);
  const double scale = std::ldexp(1.0, bits - exponent);
  return std::nearbyint(x * scale) / scale;
}

}  // namespace

HeadResult linear_cross_entropy(const std::vector<double>& hidden, const std::vector<double>& weight,
                                const std::vector<double>& bias, int64_t n, int64_t h, int64_t v,
                                const std::vector<int64_t>& targets, const std::vector<double>& weights,
                                const std::vector<double>& grad_loss, const Options& options, bool bf16_logit_gradients,
                                int logit_bits) {
  auto at = [](const std::vector<double>& m, int64_t row, int64_t cols, int64_t col) {
    return m[static_cast<std::size_t>(row * cols + col)];
  };
  HeadResult o;
  o.logits.assign(static_cast<std::size_t>(n * v), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < v; ++c) {
      const double b = bias.empty() ? 0.0 : bias[static_cast<std::size_t>(c)];
      double sum = logit_bits == 0 ? b : 0.0;
      for (int64_t k = 0; k < h; ++k) sum += at(hidden, i, h, k) * at(weight, c, h, k);
      if (logit_bits != 0) sum = rounded(rounded(sum, logit_bits) + b, logit_bits);
      o.logits[static_cast<std::size_t>(i * v + c)] = sum;
    }
  }
  o.loss = cross_entropy(o.logits, n, v, targets, weights, grad_loss, options);
  o.grad_hidden.assign(static_cast<std::size_t>(n * h), 0.0);
  o.grad_weight.assign(static_cast<std::size_t>(v * h), 0.0);
  o.grad_bias.assign(static_cast<std::size_t>(v), 0.0);
  o.grad_hidden_bound.assign(o.grad_hidden.size(), 0.0);
  o.grad_weight_bound.assign(o.grad_weight.size(), 0.0);
  o.grad_bias_bound.assign(o.grad_bias.size(), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < v; ++c) {
      double dx = o.loss.grad[static_cast<std::size_t>(i * v + c)];
      if (dx == 0.0) continue;
      const double magnitude = std::fabs(dx);
      if (bf16_logit_gradients) dx = bf16_of(dx);
      o.grad_bias[static_cast<std::size_t>(c)] += dx;
      o.grad_bias_bound[static_cast<std::size_t>(c)] += magnitude;
      for (int64_t k = 0; k < h; ++k) {
        const auto ih = static_cast<std::size_t>(i * h + k), ch = static_cast<std::size_t>(c * h + k);
        o.grad_hidden[ih] += dx * at(weight, c, h, k);
        o.grad_weight[ch] += dx * at(hidden, i, h, k);
        o.grad_hidden_bound[ih] += magnitude * std::fabs(at(weight, c, h, k));
        o.grad_weight_bound[ch] += magnitude * std::fabs(at(hidden, i, h, k));
      }
    }
  }
  return o;
}

}  // namespace vpce::reference
