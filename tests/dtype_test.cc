// tests/dtype_test.cc: the fp16 and bf16 conversions, against the compiler's _Float16 and
// against hand-checked bf16 values (round to nearest even, NaN kept, overflow to inf).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "cpu/dtype.h"

namespace vpce::detail {
namespace {

#if defined(__FLT16_MAX__) && defined(__GNUC__) && !defined(__clang__)
TEST(Float16, WideningIsExactForEveryValue) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const auto h = std::bit_cast<_Float16>(static_cast<uint16_t>(bits));
    const float want = static_cast<float>(h);
    const float got = to_float(Float16{static_cast<uint16_t>(bits)});
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << bits;
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << bits;
    }
  }
}

TEST(Float16, NarrowingRoundsLikeTheCompiler) {
  std::mt19937 rng(3);
  for (int i = 0; i < 2000000; ++i) {
    // Random bit patterns over all exponents, and values near fp16's range and ties.
    float x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (i % 3 == 1) x = std::ldexp(static_cast<float>(rng() % 4096), static_cast<int>(rng() % 50) - 36);
    if (std::isnan(x)) continue;
    const auto want = std::bit_cast<uint16_t>(static_cast<_Float16>(x));
    ASSERT_EQ(from_float<Float16>(x).bits, want) << x;
  }
}
#endif

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(from_float<BFloat16>(1.0f).bits, 0x3f80);
  EXPECT_EQ(from_float<BFloat16>(std::bit_cast<float>(0x3f808000u)).bits, 0x3f80);  // tie, even stays
  EXPECT_EQ(from_float<BFloat16>(std::bit_cast<float>(0x3f818000u)).bits, 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(from_float<BFloat16>(std::bit_cast<float>(0x3f808001u)).bits, 0x3f81);  // above tie
  EXPECT_EQ(from_float<BFloat16>(std::numeric_limits<float>::max()).bits, 0x7f80);  // overflow: inf
  EXPECT_EQ(from_float<BFloat16>(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  EXPECT_TRUE(std::isnan(to_float(from_float<BFloat16>(std::nanf("")))));
  EXPECT_EQ(to_float(BFloat16{0x4049}), 3.140625f);
}

TEST(Float16, KnownValues) {
  EXPECT_EQ(from_float<Float16>(65504.0f).bits, 0x7bff);
  EXPECT_EQ(from_float<Float16>(65520.0f).bits, 0x7c00);  // rounds up to inf
  EXPECT_EQ(from_float<Float16>(0x1p-24f).bits, 0x0001);  // smallest subnormal
  EXPECT_EQ(from_float<Float16>(0x1p-25f).bits, 0x0000);  // tie to even: zero
  EXPECT_EQ(to_float(Float16{0x3c00}), 1.0f);
  EXPECT_EQ(to_float(Float16{0xfc00}), -std::numeric_limits<float>::infinity());
}

}  // namespace
}  // namespace vpce::detail
