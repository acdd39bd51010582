// tests/reference_test.cc: the oracle itself, checked against independent statements of
// the mathematics: the closed-form loss of docs/design.md for both smoothing semantics,
// finite differences of its loss under every option, and known values.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "reference/reference.h"

namespace vpce::reference {
namespace {

std::vector<double> random_row(int64_t v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<double> row(static_cast<size_t>(v));
  for (double& x : row) x = normal(rng);
  return row;
}

TEST(Reference, UniformRowHasLossLogV) {
  const std::vector<double> row(10, 0.7);
  Options o;
  EXPECT_NEAR(token_loss(row.data(), 10, 3, o), std::log(10.0), 1e-14);
  o.label_smoothing = 0.3;
  EXPECT_NEAR(token_loss(row.data(), 10, 3, o), std::log(10.0), 1e-14);
  o.pytorch_smoothing = true;
  EXPECT_NEAR(token_loss(row.data(), 10, 3, o), std::log(10.0), 1e-14);
}

// The oracle's explicit target distributions agree with design.md's closed form
// (1 - s)(lse - z_y) + s (lse - mean z), s = a V / (V - 1) (Megatron) or a (PyTorch).
TEST(Reference, SmoothedLossEqualsTheClosedForm) {
  const int64_t v = 17;
  const std::vector<double> row = random_row(v, 1);
  double lse = 0.0, mean = 0.0;
  for (double x : row) {
    lse += std::exp(x);
    mean += x / v;
  }
  lse = std::log(lse);
  for (bool pytorch : {false, true}) {
    Options o;
    o.label_smoothing = 0.2;
    o.pytorch_smoothing = pytorch;
    const double s = pytorch ? 0.2 : 0.2 * v / (v - 1.0);
    for (int64_t target : {0, 8, 16}) {
      const double closed = (1 - s) * (lse - row[static_cast<size_t>(target)]) + s * (lse - mean);
      EXPECT_NEAR(token_loss(row.data(), v, target, o), closed, 1e-12) << pytorch;
    }
  }
}

TEST(Reference, GradientMatchesFiniteDifferencesUnderEveryOption) {
  const int64_t n = 3, v = 11;
  std::vector<double> x;
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<double> row = random_row(v, 10 + static_cast<uint64_t>(i));
    x.insert(x.end(), row.begin(), row.end());
  }
  const std::vector<int64_t> targets = {0, 5, 8};
  const std::vector<double> g = {1.0, -0.5, 2.0};
  const std::vector<double> w = {0.5, 1.5, 1.0};
  std::vector<Options> all(7);
  all[1].label_smoothing = 0.1;
  all[2].label_smoothing = 0.3;
  all[2].pytorch_smoothing = true;
  all[3].z_loss = 0.01;
  all[4].logit_scale = 0.7;
  all[5].softcap = 3.0;
  all[5].logit_scale = 1.3;
  all[6].valid_vocab = 9;
  for (const Options& o : all) {
    const Result r = cross_entropy(x, n, v, targets, w, g, o);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < v; ++j) {
        std::vector<double> plus(x.begin() + i * v, x.begin() + (i + 1) * v), minus = plus;
        plus[static_cast<size_t>(j)] += 1e-6;
        minus[static_cast<size_t>(j)] -= 1e-6;
        const auto ui = static_cast<size_t>(i);
        const double fd = g[ui] * w[ui] *
                          (token_loss(plus.data(), v, targets[ui], o) - token_loss(minus.data(), v, targets[ui], o)) /
                          2e-6;
        EXPECT_NEAR(r.grad[static_cast<size_t>(i * v + j)], fd, 1e-7) << "token " << i << " column " << j;
      }
    }
  }
}

TEST(Reference, ReductionsAndIgnoredTokens) {
  const int64_t n = 4, v = 5;
  std::vector<double> x(static_cast<size_t>(n * v), 0.0);  // uniform rows: log 5 each
  Options o;
  o.ignore_index = -1;
  const std::vector<int64_t> targets = {0, -1, 2, 4};
  const std::vector<double> w = {1.0, 7.0, 2.0, 0.0};
  o.reduction = Reduction::kSum;
  EXPECT_NEAR(cross_entropy(x, n, v, targets, w, {}, o).loss[0], 3 * std::log(5.0), 1e-14);
  o.reduction = Reduction::kMean;  // (1 + 2) log 5 / (1 + 2 + 0): the ignored token's weight does not count
  EXPECT_NEAR(cross_entropy(x, n, v, targets, w, {}, o).loss[0], std::log(5.0), 1e-14);
  const std::vector<int64_t> none = {-1, -1, -1, -1};
  const Result r = cross_entropy(x, n, v, none, {}, {}, o);
  EXPECT_EQ(r.loss[0], 0.0);
  for (double gv : r.grad) EXPECT_EQ(gv, 0.0);
}

TEST(Reference, EntropyAndArgmax) {
  const std::vector<double> x = {0.0, 0.0, 0.0, 0.0, 1.0, 3.0, 3.0, 2.0};
  const Result r = cross_entropy(x, 2, 4, {1, 1}, {}, {}, Options{});
  EXPECT_NEAR(r.entropy[0], std::log(4.0), 1e-14);
  EXPECT_EQ(r.target_is_argmax[0], 0.0);  // a four-way tie goes to column 0
  EXPECT_EQ(r.target_is_argmax[1], 1.0);  // a tie between 1 and 2 goes to column 1
}

TEST(Reference, StableForHugeLogits) {
  const std::vector<double> row = {1e4, -1e4, 1e4 - 1.0};
  const double want = std::log(1.0 + std::exp(-1.0) + std::exp(-2e4));
  EXPECT_NEAR(token_loss(row.data(), 3, 0, Options{}), want, 1e-12);
}

}  // namespace
}  // namespace vpce::reference
