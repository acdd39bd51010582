// tests/exp_test.cc: vpce's vectorised exp as the kernels take it, e^(x - s) (cpu/simd_rows.cc:
// ExpShifted, Cody-Waite on x itself with FMA), against the C library's double exp on every
// SIMD target, for shifts from 0 to 3e5: within a relative 2 * 2^-24 with FMA and 1.5 * 2^-24
// without where |x - s| <= 1 (the terms that dominate a sum), within 2 * 2^-24 with FMA and
// 2^-24 (3 + 1.25 |x - s|) without (the rounding of x - s grows with it) over the whole range
// of normal results, within one subnormal spacing more below it; and the limits
// (-inf, overflow to +inf, NaN stays NaN). And the backward's gradient where it is rounded to
// bf16 or fp16 (which takes the full exp, docs/design.md): on every target, every
// element the correctly rounded value or one of its two neighbours, most of them the former
// (on a CPU with AVX512-BF16, AVX-512 both with its instructions and without);
// and the forward's sums over bf16 and fp16 logits.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"
#include "support.h"

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
    // The targets that take x itself as the argument fold the shift's factor into the
    // polynomial (coefficients rounded once more) and do not grow with |x - s|.
    const bool exact = exp_argument_is_exact();
    const double near_bound = exact ? 2.0 : 1.5;
    const double slope = exact ? 0.0 : kSlope, at_zero = exact ? 2.0 : 3.0;
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
        const double excess = relative - (at_zero + slope * std::fabs(u));
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

// The bf16 or fp16 nearest to the double w (ties cannot matter at the tested sizes): the
// rounding of w to float, or one of its neighbours, whichever is nearest to w.
template <class H>
uint16_t nearest_half(double w) {
  if (w < 0.0) return static_cast<uint16_t>(nearest_half<H>(-w) | 0x8000u);
  const uint16_t guess = from_float<H>(static_cast<float>(w)).bits;
  uint16_t best = guess;
  double best_distance = HUGE_VAL;
  for (int delta : {-1, 0, 1}) {
    if (guess + delta < 0 || guess + delta > 0x7bff + (std::is_same_v<H, BFloat16> ? 0x400 : 0)) continue;
    const auto bits = static_cast<uint16_t>(guess + delta);
    const double distance = std::fabs(static_cast<double>(to_float(H{bits})) - w);
    if (distance < best_distance) best_distance = distance, best = bits;
  }
  return best;
}

struct HalfGradientResult {
  int64_t count = 0, exact = 0, beyond = 0;  // count, exact: of the results of 2^-126 and more
  double worst_at = 0.0;
};

// One element of a half-precision gradient against the fp64 value `want`: beyond when more
// than one unit in the last place from it correctly rounded (a bf16 result below 2^-126
// flushed to zero, as AVX512-BF16 does, excepted); exact counted over the normal results
// only (below 2^-126, AVX512-BF16 flushes, AVX2's rounding inside the exp truncates, the
// others round).
template <class H>
void tally(H got, double want, double at, HalfGradientResult& r) {
  const uint16_t nearest = nearest_half<H>(want);
  const int distance = std::abs(static_cast<int>(got.bits) - static_cast<int>(nearest));
  const bool subnormal = std::fabs(want) < 0x1p-126;
  const bool flushed = std::is_same_v<H, BFloat16> && (got.bits & 0x7FFFu) == 0 && subnormal;
  if (!subnormal) {
    ++r.count;
    if (distance == 0) ++r.exact;
  }
  if (distance > 1 && !flushed) ++r.beyond, r.worst_at = at;
}

// The gradient upstream e^(z - lse) coefficient (no smoothing, so no cancellation) rounded to H,
// with logits of type T (T = H: in place), against the fp64 value correctly rounded: every
// element within one unit in the last place of H (its spacing at the result: bits differ by
// at most 1, the values being positive).
template <class T, class H>
HalfGradientResult half_gradient(StorageType in, StorageType out, float lse, float upstream, float coefficient) {
  constexpr int64_t kCols = 1 << 16;
  std::vector<T> row(kCols);
  std::vector<double> z(kCols);
  for (int64_t v = 0; v < kCols; ++v) {
    // z - lse spread over [-90, 0.5] (p from below bf16's and fp16's normal range up to 1.6),
    // plus a dense set near 0 where the largest gradients are.
    const double u = v % 4 == 0 ? -1.0 + 1.5 * static_cast<double>(v) / kCols
                                : -90.0 + 90.5 * static_cast<double>((v * 7919) % kCols) / kCols;
    row[v] = from_float<T>(static_cast<float>(static_cast<double>(lse) + u));
    z[v] = static_cast<double>(to_float(row[v]));
  }
  std::vector<H> grad(kCols);
  void* destination = std::is_same_v<T, H> ? static_cast<void*>(row.data()) : static_cast<void*>(grad.data());
  const GradientConstants c = make_gradient_constants(upstream, lse, coefficient, 0.0);
  for (int64_t begin = 0; begin < kCols; begin += kBlockColumns) {
    const int64_t cols = std::min(kBlockColumns, kCols - begin);
    block_gradient(row.data() + begin, in, static_cast<H*>(destination) + begin, out, cols, TransformParams{}, c);
  }
  const H* got = static_cast<const H*>(destination);
  HalfGradientResult r;
  for (int64_t v = 0; v < kCols; ++v) {
    const double want = static_cast<double>(upstream) * static_cast<double>(coefficient) * std::exp(z[v] - lse);
    tally(got[v], want, z[v] - lse, r);
  }
  return r;
}

// The forward's sums over bf16 and fp16 logits:
// a block's sum of e^(z - max) against fp64, relative, on every target and for maxima of
// different sizes, well inside the loss's 1e-6 (which the oracle tests check).
TEST(Exp, ForwardSumsOfHalfLogitsOnEveryTarget) {
  for (int64_t target : targets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    for (float offset : {0.0f, 20.0f, -300.0f, 5000.0f}) {
      for (int dtype = 1; dtype <= 2; ++dtype) {
        std::vector<uint16_t> row(kBlockColumns);
        std::vector<double> z(kBlockColumns);
        double max = -HUGE_VAL;
        for (int64_t v = 0; v < kBlockColumns; ++v) {
          const auto x = static_cast<float>(offset + 12.0 * std::sin(0.37 * static_cast<double>(v)) - 4.0);
          row[v] = dtype == 1 ? from_float<BFloat16>(x).bits : from_float<Float16>(x).bits;
          z[v] = dtype == 1 ? to_float(BFloat16{row[v]}) : to_float(Float16{row[v]});
          max = std::max(max, z[v]);
        }
        if (dtype == 2 && std::fabs(offset) > 1000.0f) continue;  // beyond fp16's range
        double want = 0.0;
        for (double x : z) want += std::exp(x - max);
        const BlockStats got =
            block_stats(row.data(), static_cast<StorageType>(dtype), kBlockColumns, TransformParams{}, false, false);
        EXPECT_EQ(static_cast<double>(got.max), max) << name;
        const double relative = std::fabs(got.sum_exp - want) / want;
        // (Measured at most 1.3e-7 on every target: the fp32 sums' roundings.)
        EXPECT_LE(relative, 4e-7) << name << (dtype == 1 ? " bf16" : " fp16") << ", offset " << offset;
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Exp, HalfPrecisionGradientsWithinOneUlpOnEveryTarget) {
  for (const test::SimdVariant& variant : test::simd_variants()) {
    test::use_simd_variant(variant);
    const std::string& name = variant.name;
    for (float lse : {0.0f, 7.25f, -3.5f, 40.0f}) {
      for (auto [upstream, coefficient] :
           {std::pair{1.0f, 1.0f}, std::pair{0.37f, 1.1f}, std::pair{3e-4f, 1.0f}, std::pair{-0.37f, 1.1f}}) {
        const std::string where = name + ", lse " + std::to_string(lse) + ", upstream " + std::to_string(upstream) +
                                  ", coefficient " + std::to_string(coefficient);
        const HalfGradientResult results[4] = {
            half_gradient<BFloat16, BFloat16>(StorageType::kBFloat16, StorageType::kBFloat16, lse, upstream,
                                              coefficient),
            half_gradient<float, BFloat16>(StorageType::kFloat32, StorageType::kBFloat16, lse, upstream, coefficient),
            half_gradient<Float16, Float16>(StorageType::kFloat16, StorageType::kFloat16, lse, upstream, coefficient),
            half_gradient<float, Float16>(StorageType::kFloat32, StorageType::kFloat16, lse, upstream, coefficient)};
        const char* labels[4] = {"bf16 in place", "fp32 -> bf16", "fp16 in place", "fp32 -> fp16"};
        // Measured over the normal results with the full exp: every one exactly rounded, on
        // every target (the bars are those the lower degrees once met, 98.1 and 99.7 %).
        const double at_least[4] = {0.97, 0.97, 0.995, 0.995};
        for (int k = 0; k < 4; ++k) {
          const HalfGradientResult& r = results[k];
          EXPECT_EQ(r.beyond, 0) << where << ", " << labels[k]
                                 << ": more than 1 ulp off, e.g. at z - lse = " << r.worst_at;
          const double fraction = static_cast<double>(r.exact) / static_cast<double>(r.count);
          EXPECT_GE(fraction, at_least[k]) << where << ", " << labels[k] << ": exactly rounded";
          if (lse == 7.25f && upstream == 1.0f) {
            std::printf("%-7s %-14s exactly rounded %.4f\n", name.c_str(), labels[k], fraction);
          }
        }
      }
    }
  }
  test::use_best_simd_variant();
}

// bf16 gradients of large logits, in place: AVX2 adds the power of two to k e^r's bits
// before the rounding, where the lse's size sets E, and AVX-512 takes the
// factor's rounding into the scale where |E| <= 1024 (docs/design.md: the logit 650, whose
// lse's E crosses that limit, takes both ways). One bf16 logit z0 in a row of 64 and lse swept over z0 - u, u in
// [-85, 0.5] (87 columns: two pairs of vectors, one vector and a partial one on AVX-512):
// every element within one ulp of the fp64 value correctly rounded, at least 97 % of the
// normal ones exactly, for both signs of the upstream gradient.
TEST(Exp, HalfPrecisionGradientsOfLargeLogitsOnEveryTarget) {
  constexpr int64_t kCols = 87;
  for (const test::SimdVariant& variant : test::simd_variants()) {
    test::use_simd_variant(variant);
    const std::string& name = variant.name;
    for (float logit : {650.0f, 3000.0f, 12000.0f, 16500.0f, 30000.0f, 44000.0f, 60000.0f}) {
      for (float upstream : {0.7f, -2.5e-4f}) {
        const BFloat16 z0 = from_float<BFloat16>(logit);
        const double z = static_cast<double>(to_float(z0));
        HalfGradientResult r;
        for (int i = 0; i < 1000; ++i) {
          const auto lse = static_cast<float>(z + 85.0 - 85.5 * i / 1000.0);
          std::vector<BFloat16> row(kCols, z0);
          block_gradient(row.data(), StorageType::kBFloat16, row.data(), StorageType::kBFloat16, kCols,
                         TransformParams{}, make_gradient_constants(upstream, lse, 1.0, 0.0));
          const double want = static_cast<double>(upstream) * std::exp(z - static_cast<double>(lse));
          for (const BFloat16& g : row) tally(g, want, z - static_cast<double>(lse), r);
        }
        const std::string where =
            name + ", logit " + std::to_string(to_float(z0)) + ", upstream " + std::to_string(upstream);
        EXPECT_EQ(r.beyond, 0) << where << ", e.g. at z - lse = " << r.worst_at;
        EXPECT_GE(static_cast<double>(r.exact) / static_cast<double>(r.count), 0.97)
            << where;  // measured: 98.6 % at least
      }
    }
  }
  test::use_best_simd_variant();
}

// bf16 gradients in place around the least logit whose result is a normal number (AVX2
// adds the exponent where every result of four vectors is one, and tests that on the logits'
// bf16 patterns where that logit is negative). Rows of 64 logits, each at lse - 1 but one,
// which takes every bf16 value from 100 below the lse to 60 below it, -inf and a NaN with
// the sign set, at every position in turn: every element within one ulp of the fp64 value
// correctly rounded (or flushed below 2^-126), for bounds below 0 and above it, and for
// factors that move the bound (upstream of 3e-4) or not.
TEST(Exp, HalfPrecisionGradientsAroundTheNormalResultsBoundOnEveryTarget) {
  constexpr int64_t kCols = 64;
  for (const test::SimdVariant& variant : test::simd_variants()) {
    test::use_simd_variant(variant);
    for (float lse : {0.0f, 7.25f, 40.0f, 150.0f}) {
      for (float upstream : {1.0f, 3e-4f, -0.37f}) {
        std::vector<float> swept;
        for (BFloat16 z = from_float<BFloat16>(lse - 100.0f); to_float(z) <= lse - 60.0f;
             z.bits = static_cast<uint16_t>(to_float(z) < 0.0f ? z.bits - 1 : z.bits + 1)) {
          swept.push_back(to_float(z));
        }
        swept.push_back(-kInf);
        const std::string where =
            variant.name + ", lse " + std::to_string(lse) + ", upstream " + std::to_string(upstream);
        HalfGradientResult r;
        int nan_missed = 0;
        const BFloat16 negative_nan{0xFFC1};
        for (size_t i = 0; i <= swept.size(); ++i) {
          std::vector<BFloat16> row(kCols, from_float<BFloat16>(lse - 1.0f));
          const int64_t at = static_cast<int64_t>(i * 13) % kCols;
          row[at] = i < swept.size() ? from_float<BFloat16>(swept[i]) : negative_nan;
          std::vector<double> z(kCols);
          for (int64_t v = 0; v < kCols; ++v) z[v] = static_cast<double>(to_float(row[v]));
          block_gradient(row.data(), StorageType::kBFloat16, row.data(), StorageType::kBFloat16, kCols,
                         TransformParams{}, make_gradient_constants(upstream, lse, 1.0, 0.0));
          for (int64_t v = 0; v < kCols; ++v) {
            if (std::isnan(z[v])) {
              nan_missed += std::isnan(to_float(row[v])) ? 0 : 1;
            } else {
              tally(row[v], static_cast<double>(upstream) * std::exp(z[v] - static_cast<double>(lse)), z[v] - lse, r);
            }
          }
        }
        EXPECT_EQ(r.beyond, 0) << where << ", e.g. at z - lse = " << r.worst_at;
        EXPECT_EQ(nan_missed, 0) << where;
      }
    }
  }
  test::use_best_simd_variant();
}

}  // namespace
}  // namespace vpce::detail
