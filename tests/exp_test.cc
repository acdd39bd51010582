// tests/exp_test.cc: vpce's vectorised exp (cpu/simd_rows.cc) against the C library's
// double exp on every SIMD target: within 1 ulp over the whole range of normal results
// (1.25 ulp on the targets without fused multiply-add: SSE4, SSSE3, scalar), within one
// subnormal spacing below it, and the limits (-inf, NaN, overflow to +inf, and never a
// finite value for arguments beyond the overflow range).
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu/simd_rows.h"

namespace vpce::detail {
namespace {

// |got - want| in units of the spacing of floats at want (the subnormal spacing below 2^-126).
double ulps(float got, double want) {
  if (want == 0.0) return got == 0.0f ? 0.0 : HUGE_VAL;
  int exponent = 0;
  std::frexp(want, &exponent);  // want = m 2^exponent, m in [0.5, 1)
  const double spacing = std::ldexp(1.0, std::max(exponent - 24, -149));
  return std::fabs(static_cast<double>(got) - want) / spacing;
}

// Evenly spaced arguments over [lo, hi), plus small ones around 0 (where exp(x) = 1 + x).
std::vector<float> arguments(float lo, float hi, int count) {
  std::vector<float> x;
  for (int i = 0; i < count; ++i) x.push_back(lo + (hi - lo) * static_cast<float>(i) / static_cast<float>(count));
  for (int i = -1000; i <= 1000; ++i) x.push_back(static_cast<float>(i) * 1e-7f);
  return x;
}

std::vector<int64_t> targets() {
  std::vector<int64_t> t;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) t.push_back(target);
  return t;
}

TEST(Exp, WithinOneUlpOnEveryTarget) {
  const std::vector<float> x = arguments(-87.33f, 88.72f, 1 << 22);  // normal results
  for (int64_t target : targets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::vector<float> y = x;
    exp_lanes(y.data(), y.data(), static_cast<int64_t>(y.size()));
    double worst = 0.0;
    float worst_at = 0.0f;
    for (size_t i = 0; i < x.size(); ++i) {
      const double e = ulps(y[i], std::exp(static_cast<double>(x[i])));
      if (e > worst) worst = e, worst_at = x[i];
    }
    const bool fused = (target & (HWY_AVX2 | HWY_AVX3)) != 0;
    EXPECT_LE(worst, fused ? 1.0 : 1.25) << hwy::TargetName(target) << " at x = " << worst_at;
    EXPECT_EQ(exp_one(x[12345]), y[12345]) << hwy::TargetName(target) << ": exp_one differs from the vector exp";
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Exp, SubnormalResultsWithinOneSpacing) {
  const std::vector<float> x = arguments(-103.9f, -87.33f, 1 << 18);
  for (int64_t target : targets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::vector<float> y = x;
    exp_lanes(y.data(), y.data(), static_cast<int64_t>(y.size()));
    double worst = 0.0;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i] < -87.33f) worst = std::max(worst, ulps(y[i], std::exp(static_cast<double>(x[i]))));
    }
    EXPECT_LE(worst, 1.0) << hwy::TargetName(target);
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Exp, Limits) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t target : targets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    std::vector<float> y = {-kInf, -1e30f, -200.0f, -104.0f, 0.0f,  -0.0f, 1.0f,
                            88.7f, 88.73f, 89.0f,   2.9e6f, 1e30f,  kInf,  std::numeric_limits<float>::quiet_NaN()};
    exp_lanes(y.data(), y.data(), static_cast<int64_t>(y.size()));
    EXPECT_EQ(y[0], 0.0f) << name;
    EXPECT_EQ(y[1], 0.0f) << name;
    EXPECT_EQ(y[2], 0.0f) << name;
    EXPECT_LE(y[3], 0x1p-149f) << name;
    EXPECT_EQ(y[4], 1.0f) << name;
    EXPECT_EQ(y[5], 1.0f) << name;
    EXPECT_LE(ulps(y[6], std::exp(1.0)), 1.0) << name;
    EXPECT_LE(ulps(y[7], std::exp(static_cast<double>(88.7f))), 1.0) << name;
    EXPECT_EQ(y[8], kInf) << name;
    EXPECT_EQ(y[9], kInf) << name;
    EXPECT_EQ(y[10], kInf) << name;
    EXPECT_FALSE(std::isfinite(y[11])) << name << ": exp(1e30) must not be finite";
    EXPECT_FALSE(std::isfinite(y[12])) << name << ": exp(+inf) must not be finite";
    EXPECT_EQ(y[13], 0.0f) << name << ": a NaN argument gives 0, as Highway's Exp did";
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
}  // namespace vpce::detail
