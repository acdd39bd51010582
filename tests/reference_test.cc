// tests/reference_test.cc: the oracle itself, checked against independent statements of
// the mathematics: finite differences of its loss, the cross-entropy against an explicit
// smoothed target distribution (Megatron's semantics), and closed forms.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "reference/reference.h"

namespace vpce::reference {
namespace {

TEST(Reference, UniformRowHasLossLogV) {
  const std::vector<double> row(10, 0.7);
  EXPECT_NEAR(token_loss(row.data(), 10, 3, 0.0), std::log(10.0), 1e-14);
  EXPECT_NEAR(token_loss(row.data(), 10, 3, 0.3), std::log(10.0), 1e-14);
}

// Megatron's semantics: the target gets 1 - a and every other class a / (V - 1).
TEST(Reference, LabelSmoothingIsCrossEntropyWithSmoothedTargets) {
  std::mt19937_64 rng(1);
  std::normal_distribution<double> normal(0.0, 2.0);
  const int64_t v = 17;
  std::vector<double> row(v);
  for (double& x : row) x = normal(rng);
  const double a = 0.2;
  double lse = 0.0;
  for (double x : row) lse += std::exp(x);
  lse = std::log(lse);
  for (int64_t target : {0, 8, 16}) {
    double explicit_loss = 0.0;
    for (int64_t j = 0; j < v; ++j) {
      const double q = j == target ? 1.0 - a : a / (v - 1.0);
      explicit_loss -= q * (row[static_cast<size_t>(j)] - lse);
    }
    EXPECT_NEAR(token_loss(row.data(), v, target, a), explicit_loss, 1e-12);
  }
}

TEST(Reference, GradientMatchesFiniteDifferences) {
  std::mt19937_64 rng(2);
  std::normal_distribution<double> normal(0.0, 3.0);
  const int64_t n = 3, v = 11;
  std::vector<double> x(static_cast<size_t>(n * v));
  for (double& e : x) e = normal(rng);
  const std::vector<int64_t> targets = {0, 5, 10};
  const std::vector<double> g = {1.0, -0.5, 2.0};
  for (double a : {0.0, 0.1, 0.9}) {
    const Result r = cross_entropy(x, n, v, targets, a, g);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < v; ++j) {
        std::vector<double> plus(x.begin() + i * v, x.begin() + (i + 1) * v), minus = plus;
        plus[static_cast<size_t>(j)] += 1e-6;
        minus[static_cast<size_t>(j)] -= 1e-6;
        const double fd = g[static_cast<size_t>(i)] *
                          (token_loss(plus.data(), v, targets[static_cast<size_t>(i)], a) -
                           token_loss(minus.data(), v, targets[static_cast<size_t>(i)], a)) / 2e-6;
        EXPECT_NEAR(r.grad[static_cast<size_t>(i * v + j)], fd, 1e-7);
      }
    }
  }
}

TEST(Reference, StableForHugeLogits) {
  const std::vector<double> row = {1e4, -1e4, 1e4 - 1.0};
  const double want = std::log(1.0 + std::exp(-1.0) + std::exp(-2e4));
  EXPECT_NEAR(token_loss(row.data(), 3, 0, 0.0), want, 1e-12);
}

}  // namespace
}  // namespace vpce::reference
