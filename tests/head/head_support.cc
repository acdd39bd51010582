// tests/head/head_support.cc: the fused head's test problems and oracle (head_support.h).
#include "head_support.h"

#include <cmath>
#include <random>

#include "cpu/dtype.h"

namespace vpce::test {

double HeadProblem::hidden_at(int64_t i, int64_t k) const {
  return detail::widen(hidden_storage.data() + dtype.bytes() + (i * ld_hidden + k) * dtype.bytes(), dtype);
}
double HeadProblem::weight_at(int64_t v, int64_t k) const {
  return detail::widen(weight_storage.data() + (v * ld_weight + k) * dtype.bytes(), dtype);
}
double HeadProblem::bias_at(int64_t v) const {
  return with_bias ? detail::widen(bias_storage.data() + v * dtype.bytes(), dtype) : 0.0;
}
void HeadProblem::set_hidden(int64_t i, int64_t k, float value) {
  detail::narrow(value, hidden_storage.data() + dtype.bytes() + (i * ld_hidden + k) * dtype.bytes(), dtype);
}
void HeadProblem::set_bias(int64_t v, float value) { detail::narrow(value, bias_storage.data() + v * dtype.bytes(), dtype); }

TensorView HeadProblem::hidden_view() { return TensorView::matrix(hidden_base(), dtype, tokens, hidden, ld_hidden); }
TensorView HeadProblem::weight_view(int64_t begin, int64_t end) {
  return TensorView::matrix(weight_base() + begin * ld_weight * dtype.bytes(), dtype, end - begin, hidden, ld_weight);
}
TensorView HeadProblem::bias_view(int64_t begin, int64_t end) {
  return TensorView::contiguous(bias_storage.data() + begin * dtype.bytes(), dtype, {end - begin});
}

HeadProblem random_head_problem(int64_t tokens, int64_t hidden, int64_t vocab, DataType dtype, uint64_t seed,
                                float std, bool with_bias) {
  HeadProblem p;
  p.tokens = tokens;
  p.hidden = hidden;
  p.vocab = vocab;
  p.dtype = dtype;
  p.with_bias = with_bias;
  p.ld_hidden = hidden + 3;
  p.ld_weight = hidden + 5;
  const int bytes = dtype.bytes();
  p.hidden_storage.resize(static_cast<std::size_t>((tokens * p.ld_hidden + 1) * bytes));
  p.weight_storage.resize(static_cast<std::size_t>(vocab * p.ld_weight * bytes + 1));
  p.bias_storage.resize(static_cast<std::size_t>(vocab * bytes + 1));
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> h(0.0f, std), w(0.0f, 1.0f / std::sqrt(static_cast<float>(hidden))),
      b(0.0f, 0.5f);
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t k = 0; k < hidden; ++k) p.set_hidden(i, k, h(gen));
  }
  for (int64_t v = 0; v < vocab; ++v) {
    for (int64_t k = 0; k < hidden; ++k) {
      detail::narrow(w(gen), p.weight_storage.data() + (v * p.ld_weight + k) * bytes, dtype);
    }
    p.set_bias(v, with_bias ? b(gen) : 0.0f);
  }
  std::uniform_int_distribution<int64_t> t(0, vocab - 1);
  std::uniform_real_distribution<float> g(0.5f, 2.0f);
  for (int64_t i = 0; i < tokens; ++i) {
    p.targets.push_back(i % 7 == 3 ? -100 : t(gen));
    p.grad_loss.push_back(g(gen));
  }
  return p;
}

HeadOracle head_oracle(const HeadProblem& p, const LossOptions& options, float grad_scalar, bool bf16_logit_gradients) {
  HeadOracle o;
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  o.logits.assign(static_cast<std::size_t>(n * v), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < v; ++c) {
      double sum = p.bias_at(c);
      for (int64_t k = 0; k < h; ++k) sum += p.hidden_at(i, k) * p.weight_at(c, k);
      o.logits[static_cast<std::size_t>(i * v + c)] = sum;
    }
  }
  const reference::Options ro = reference_options(options);
  const std::vector<double> grad_loss = options.reduction == Reduction::kNone
                                            ? widen(p.grad_loss)
                                            : std::vector<double>{static_cast<double>(grad_scalar)};
  o.loss = reference::cross_entropy(o.logits, n, v, p.targets, widen(p.weights), grad_loss, ro);
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
      if (bf16_logit_gradients) dx = detail::to_float(detail::from_float<detail::BFloat16>(static_cast<float>(dx)));
      o.grad_bias[static_cast<std::size_t>(c)] += dx;
      o.grad_bias_bound[static_cast<std::size_t>(c)] += magnitude;
      for (int64_t k = 0; k < h; ++k) {
        const auto ih = static_cast<std::size_t>(i * h + k), ch = static_cast<std::size_t>(c * h + k);
        o.grad_hidden[ih] += dx * p.weight_at(c, k);
        o.grad_weight[ch] += dx * p.hidden_at(i, k);
        o.grad_hidden_bound[ih] += magnitude * std::fabs(p.weight_at(c, k));
        o.grad_weight_bound[ch] += magnitude * std::fabs(p.hidden_at(i, k));
      }
    }
  }
  return o;
}

}  // namespace vpce::test
