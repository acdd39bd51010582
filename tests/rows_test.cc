// tests/rows_test.cc: the composable row kernels (vpce/rows.h) on every SIMD target against
// the fp64 definitions: the row max (NaN rows, -inf rows, bf16 and fp16 widened in the same
// read), exp(x - shift) in place within 1.25 ulp of the double exp of the same fp32 difference,
// and the row sums; strided, misaligned rows; rows that span several chunks; bad arguments.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "support.h"
#include "vpce/rows.h"

namespace vpce::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Distance in units in the last place of want (fp32), for finite values.
double ulps(float got, double want) {
  const double spacing = std::ldexp(1.0, std::max(std::ilogb(static_cast<float>(want)), -126) - 23);
  return std::fabs(static_cast<double>(got) - want) / spacing;
}

TEST(Rows, MaxAndWidenMatchTheDefinitionOnEveryTarget) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DataType dtype : {kFloat32, kBFloat16, kFloat16}) {
      for (int64_t cols : {1, 15, 16, 33, 1000, 5000}) {
        Problem p = random_problem(6, cols, dtype, static_cast<uint64_t>(cols), 3.0f);
        p.set(1, cols - 1, std::numeric_limits<float>::quiet_NaN());  // the last element
        for (int64_t v = 0; v < cols; ++v) p.set(2, v, -kInf);        // no max but -inf
        p.set(3, 0, kInf);
        if (cols > 16) {
          for (int64_t v = 0; v < 16; ++v) p.set(4, v, std::numeric_limits<float>::quiet_NaN());  // a vector
        }
        std::vector<float> max(6, 0.0f), wide(static_cast<size_t>(6 * cols), 0.0f);
        const TensorView max_view = TensorView::contiguous(max.data(), kFloat32, {6});
        const TensorView wide_view = TensorView::contiguous(wide.data(), kFloat32, {6, cols});
        ASSERT_TRUE(row_max(p.shard_view({0, cols, cols}), max_view, &wide_view, 2).ok());
        const std::string where =
            std::string(hwy::TargetName(target)) + " " + to_string(dtype) + " K " + std::to_string(cols);
        for (int64_t i = 0; i < 6; ++i) {
          double want = -HUGE_VAL;
          bool nan = false;
          for (int64_t v = 0; v < cols; ++v) {
            const double x = p.at(i, v);
            nan |= std::isnan(x);
            want = std::max(want, x);
            const float w = wide[static_cast<size_t>(i * cols + v)];
            ASSERT_TRUE(std::isnan(x) ? std::isnan(w) : static_cast<double>(w) == x)
                << where << " row " << i << " column " << v;
          }
          if (nan) {
            EXPECT_TRUE(std::isnan(max[static_cast<size_t>(i)])) << where << " row " << i;
          } else {
            EXPECT_EQ(static_cast<double>(max[static_cast<size_t>(i)]), want) << where << " row " << i;
          }
        }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Rows, ExpInPlaceAndSumsMatchTheDefinitionOnEveryTarget) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (int64_t cols : {1, 7, 32, 100, 2049, 20000}) {
      Problem p = random_problem(5, cols, kFloat32, static_cast<uint64_t>(cols) + 7, 20.0f);
      p.set(1, 0, -kInf);
      p.set(2, cols - 1, std::numeric_limits<float>::quiet_NaN());
      std::vector<float> shift = {0.0f, 3.5f, -2.0f, 60.0f, -80.0f};
      const Problem before = p;
      std::vector<float> sums(5, 0.0f);
      const TensorView shift_view = TensorView::contiguous(shift.data(), kFloat32, {5});
      const TensorView sums_view = TensorView::contiguous(sums.data(), kFloat32, {5});
      ASSERT_TRUE(exp_rows_in_place(p.shard_view({0, cols, cols}), shift_view, &sums_view, 2).ok());
      const std::string where = std::string(hwy::TargetName(target)) + " K " + std::to_string(cols);
      for (int64_t i = 0; i < 5; ++i) {
        double sum = 0.0, worst = 0.0;
        for (int64_t v = 0; v < cols; ++v) {
          const auto difference =
              static_cast<float>(before.at(i, v) - shift[static_cast<size_t>(i)]);  // rounded, as x -= max
          const double want = std::exp(static_cast<double>(difference));
          const auto got = static_cast<float>(p.at(i, v));
          sum += want;
          if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(got)) << where;
          } else if (want == 0.0 || want > 3.4e38) {
            ASSERT_EQ(static_cast<double>(got), want < 1.0 ? 0.0 : HUGE_VAL) << where << " x - s " << difference;
          } else if (want >= 0x1p-126) {
            worst = std::max(worst, ulps(got, want));
          } else {
            ASSERT_LE(std::fabs(got - want), 0x1p-149) << where;  // subnormal results: one spacing
          }
        }
        EXPECT_LE(worst, 1.25) << where << " row " << i;
        const float got_sum = sums[static_cast<size_t>(i)];
        if (std::isnan(sum)) {
          EXPECT_TRUE(std::isnan(got_sum)) << where;
        } else if (sum > std::numeric_limits<float>::max()) {
          EXPECT_EQ(got_sum, kInf) << where << " row " << i;  // the sum overflows fp32
        } else {  // the elements' rounding, and one subnormal spacing each below 2^-126
          EXPECT_LE(std::fabs(got_sum - sum), 4e-7 * sum + 0x1p-149 * static_cast<double>(cols))
              << where << " row " << i;
        }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(Rows, ThreadCountsGiveTheSameBits) {
  Problem a = random_problem(37, 3000, kFloat32, 5, 4.0f);
  Problem b = a;
  std::vector<float> shift(37, 1.0f), sums_a(37), sums_b(37);
  const TensorView shift_view = TensorView::contiguous(shift.data(), kFloat32, {37});
  const TensorView sa = TensorView::contiguous(sums_a.data(), kFloat32, {37});
  const TensorView sb = TensorView::contiguous(sums_b.data(), kFloat32, {37});
  ASSERT_TRUE(exp_rows_in_place(a.shard_view({0, 3000, 3000}), shift_view, &sa, 1).ok());
  ASSERT_TRUE(exp_rows_in_place(b.shard_view({0, 3000, 3000}), shift_view, &sb, 2).ok());
  EXPECT_EQ(a.storage, b.storage);
  EXPECT_EQ(sums_a, sums_b);
}

TEST(Rows, BadArgumentsAreNamedAndWriteNothing) {
  Problem p = random_problem(4, 10, kFloat32, 1);
  const Problem before = p;
  std::vector<float> small(3, 7.0f), shift(4, 0.0f);
  std::vector<double> wide(4, 0.0);
  const TensorView x = p.shard_view({0, 10, 10});
  auto message = [](const Status& s) { return s.to_string(); };
  const TensorView three = TensorView::contiguous(small.data(), kFloat32, {3});
  EXPECT_NE(message(row_max(x, three)).find("max.shape: expected 4 elements"), std::string::npos)
      << message(row_max(x, three));
  const TensorView doubles = TensorView::contiguous(wide.data(), kFloat64, {4});
  EXPECT_NE(message(row_max(x, doubles)).find("max.dtype: expected float32, got float64"), std::string::npos);
  const TensorView shift_view = TensorView::contiguous(shift.data(), kFloat32, {4});
  EXPECT_NE(message(row_max(x, shift_view, nullptr, -1)).find("num_threads: expected in [0, "), std::string::npos);
  Problem half = random_problem(4, 10, kBFloat16, 1);
  EXPECT_NE(message(exp_rows_in_place(half.shard_view({0, 10, 10}), shift_view))
                .find("x.dtype: expected float32, got bfloat16"),
            std::string::npos);
  EXPECT_NE(message(exp_rows_in_place(x, three)).find("shift.shape: expected 4 elements"), std::string::npos);
  const TensorView inside = TensorView::contiguous(p.base(), kFloat32, {4});  // the sums inside x
  EXPECT_NE(message(exp_rows_in_place(x, shift_view, &inside)).find("sums: expected memory that does not overlap"),
            std::string::npos);
  // A view labelled as a device's (host memory here, so that a wrong read would not crash):
  // refused by name, as every other entry refuses it (it was read, or written, as the host's).
  const Device gpu{DeviceType::kCUDA, 0};
  TensorView on_gpu = x;
  on_gpu.device = gpu;
  std::vector<float> four(4, 7.0f);
  const TensorView max_view = TensorView::contiguous(four.data(), kFloat32, {4});
  EXPECT_NE(message(row_max(on_gpu, max_view))
                .find("logits.device: expected cpu (the row kernels run on the host), "
                      "got cuda:0"),
            std::string::npos)
      << message(row_max(on_gpu, max_view));
  TensorView max_on_gpu = max_view;
  max_on_gpu.device = gpu;
  EXPECT_NE(message(row_max(x, max_on_gpu)).find("max.device: expected cpu"), std::string::npos);
  EXPECT_NE(message(exp_rows_in_place(on_gpu, shift_view)).find("x.device: expected cpu"), std::string::npos);
  TensorView shift_on_gpu = shift_view;
  shift_on_gpu.device = gpu;
  EXPECT_NE(message(exp_rows_in_place(x, shift_on_gpu)).find("shift.device: expected cpu"), std::string::npos);
  EXPECT_EQ(four, std::vector<float>(4, 7.0f));
  EXPECT_EQ(p.storage, before.storage);
  EXPECT_EQ(small, std::vector<float>(3, 7.0f));
}

}  // namespace
}  // namespace vpce::test
