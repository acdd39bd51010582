// tests/exp_test.cc: vpce's vectorised exp as the kernels take it, e^(x - s) (cpu/simd_rows.cc:
// ExpShifted; base 2 on AVX-512, Cody-Waite elsewhere), against the C library's double exp on
// every SIMD target, for shifts from 0 to 3e5: within a relative 3 * 2^-24 on AVX-512 and
// 1.5 * 2^-24 elsewhere where |x - s| <= 1 (the terms that dominate a sum), within
// 2^-24 (3 + 1.25 |x - s|) over the whole range of normal results (the rounding of the
// argument grows with it), within one subnormal spacing more below it; and the limits
// (-inf, overflow to +inf, NaN stays NaN).
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu/simd_rows.h"

namespace vpce::detail {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<int64_t> targets() {
  std::vector<int64_t> t;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) t.push_back(target);
  return t;
}

constexpr double kSlope = 1.25;  // of the bound, per unit of |x - s|

// s + u for u evenly spaced over [lo, hi), plus small u around 0, rounded to fp32.
std::vector<float> arguments(float s, float lo, float hi, int count) {
  std::vector<float> x;
  for (int i = 0; i < count; ++i) x.push_back(s + (lo + (hi - lo) * static_cast<float>(i) / static_cast<float>(count)));
  for (int i = -1000; i <= 1000; ++i) x.push_back(s + static_cast<float>(i) * 1e-4f);
  return x;
}

TEST(Exp, WithinBoundOnEveryTargetAndShift) {
  for (int64_t target : targets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    const double near_bound = target == HWY_AVX3 ? 3.0 : 1.5;
    for (float s : {0.0f, 1.0f, 12.3456f, -30.0f, 1e4f, -1e4f, 3e5f}) {
      const std::vector<float> x = arguments(s, -87.3f, 0.5f, 1 << 20);
      std::vector<float> y(x.size());
      exp_shifted_lanes(x.data(), s, y.data(), static_cast<int64_t>(y.size()));
      double worst_near = 0.0, worst_excess = -1.0;
      float worst_at = 0.0f;
      for (size_t i = 0; i < x.size(); ++i) {
        const double u = static_cast<double>(x[i]) - static_cast<double>(s);  // exact
        const double want = std::exp(u);
        const double relative = std::fabs(static_cast<double>(y[i]) - want) / want / 0x1p-24;
        if (std::fabs(u) <= 1.0) worst_near = std::max(worst_near, relative);
        const double excess = relative - (3.0 + kSlope * std::fabs(u));
        if (excess > worst_excess) worst_excess = excess, worst_at = x[i];
      }
      EXPECT_LE(worst_near, near_bound) << name << ", s = " << s << ": relative error near s, in units of 2^-24";
      EXPECT_LE(worst_excess, 0.0) << name << ", s = " << s << ": beyond the bound at x = " << worst_at;
      EXPECT_EQ(exp_shifted_one(x[12345], s), y[12345]) << name << ": exp_shifted_one differs from the lanes";
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Exp, SubnormalResultsWithinOneSpacingMore) {
  const std::vector<float> x = arguments(0.0f, -103.9f, -87.33f, 1 << 18);
  for (int64_t target : targets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::vector<float> y(x.size());
    exp_shifted_lanes(x.data(), 0.0f, y.data(), static_cast<int64_t>(y.size()));
    double worst = 0.0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double u = static_cast<double>(x[i]);
      if (u >= -87.33) continue;
      const double want = std::exp(u);
      const double allowed = 0x1p-149 + want * 0x1p-24 * (3.0 + kSlope * std::fabs(u));
      worst = std::max(worst, std::fabs(static_cast<double>(y[i]) - want) / allowed);
    }
    EXPECT_LE(worst, 1.0) << hwy::TargetName(target);
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Exp, Limits) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t target : targets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    std::vector<float> y = {-kInf, -1e30f, -200.0f, -104.0f, 0.0f, -0.0f, 1.0f, 88.73f, 89.0f, 1e30f, kInf, nan};
    exp_shifted_lanes(y.data(), 0.0f, y.data(), static_cast<int64_t>(y.size()));
    EXPECT_EQ(y[0], 0.0f) << name;
    EXPECT_EQ(y[1], 0.0f) << name;
    EXPECT_EQ(y[2], 0.0f) << name;
    EXPECT_LE(y[3], 0x1p-149f) << name;
    EXPECT_EQ(y[4], 1.0f) << name;
    EXPECT_EQ(y[5], 1.0f) << name;
    EXPECT_NEAR(y[6], std::exp(1.0), 3e-7) << name;
    EXPECT_EQ(y[7], kInf) << name;
    EXPECT_EQ(y[8], kInf) << name;
    EXPECT_EQ(y[9], kInf) << name;
    EXPECT_EQ(y[10], kInf) << name;
    EXPECT_TRUE(std::isnan(y[11])) << name << ": a NaN argument must stay NaN";
    // Shifted: -inf gives 0 and +inf gives +inf whatever the shift; a NaN or infinite shift NaN.
    EXPECT_EQ(exp_shifted_one(-kInf, 1e4f), 0.0f) << name;
    EXPECT_EQ(exp_shifted_one(kInf, -5.0f), kInf) << name;
    EXPECT_TRUE(std::isnan(exp_shifted_one(1.0f, nan))) << name;
    EXPECT_TRUE(std::isnan(exp_shifted_one(kInf, kInf))) << name;
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
}  // namespace vpce::detail
