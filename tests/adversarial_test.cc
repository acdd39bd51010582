// tests/adversarial_test.cc: rows that break naive implementations: logits of +-1e4,
// -inf columns, a whole shard of -inf, targets on shard boundaries, uniform rows, one
// dominant column; checked against the fp64 oracle, and for finiteness.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>

#include "reference/reference.h"
#include "support.h"

namespace vpce::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kVocab = 64;  // 4 shards of 16

Problem adversarial_problem(DataType dtype) {
  Problem p = random_problem(10, kVocab, dtype, 11, 1.0f);
  const int64_t targets[] = {3, 0, 15, 16, 31, 32, 63, 40, 7, 50};
  for (int64_t i = 0; i < 10; ++i) p.targets[static_cast<size_t>(i)] = targets[i];
  for (int64_t v = 0; v < kVocab; ++v) {
    p.set(1, v, v % 5 == 1 ? -kInf : p.at(1, v) > 0 ? 1.0f : -1.0f);  // -inf columns, not the target
    if (v >= 16 && v < 32) p.set(2, v, -kInf);                        // rank 1's whole shard
    p.set(7, v, 0.25f);                                               // uniform row
    p.set(8, v, v == 50 ? 80.0f : -3.0f);                             // one dominant column
    p.set(9, v, v < 48 ? -kInf : static_cast<float>(v - 48));         // three shards of -inf
  }
  return p;
}

TEST(Adversarial, InfinityColumnsShardsAndBoundariesMatchOracle) {
  for (DataType dtype : {kFloat32, kBFloat16, kFloat16}) {
    Problem problem = adversarial_problem(dtype);
    const std::vector<double> x = problem.as_double();
    RunOptions options;
    const RunResult result = run_ranks(problem, shards_from_sizes(even_splits(kVocab, 4)), options);
    for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
    const auto want = reference::cross_entropy(x, 10, kVocab, problem.targets, 0.0, widen(problem.grad_loss));
    for (double l : result.per_rank[0].loss) EXPECT_TRUE(std::isfinite(l));
    for (double g : result.grad) EXPECT_TRUE(std::isfinite(g));
    EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6) << to_string(dtype);
    EXPECT_LE(relative_error(result.grad, want.grad), 1e-6) << to_string(dtype);
  }
}

// Logits of +-1e4 (bar: finite loss and gradient, with label smoothing 0.1 and R = 4), the
// loss within 1e-6 (it is (max - z_target) + log(sum)). With the lse kept in float64 the
// gradient is within 1e-6 too; kept in float32, whose spacing at 1e4 is 2^-10, p = exp(z -
// lse) is good only to about 1e-3 relative there.
TEST(Adversarial, HugeLogitsStayFinite) {
  for (float smoothing : {0.0f, 0.1f}) {
    Problem problem = random_problem(16, 4096, kFloat32, 21);
    std::mt19937_64 rng(4);
    for (int64_t i = 0; i < 16; ++i) {
      for (int64_t v = 0; v < 4096; ++v) problem.set(i, v, (rng() & 1) ? 1e4f : -1e4f);
    }
    problem.set(3, 100, 1e4f + 1.0f);
    const std::vector<double> x = problem.as_double();
    const auto want = reference::cross_entropy(x, 16, 4096, problem.targets, smoothing, widen(problem.grad_loss));
    for (DataType lse_dtype : {kFloat64, kFloat32}) {
      SCOPED_TRACE("lse " + to_string(lse_dtype) + ", smoothing " + std::to_string(smoothing));
      RunOptions options;
      options.loss.label_smoothing = smoothing;
      options.lse_dtype = lse_dtype;
      Problem copy = problem;
      const RunResult result = run_ranks(copy, shards_from_sizes(even_splits(4096, 4)), options);
      for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
      for (float l : result.per_rank[0].loss) EXPECT_TRUE(std::isfinite(l));
      for (double g : result.grad) EXPECT_TRUE(std::isfinite(g));
      EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6);
      const double grad_error = relative_error(result.grad, want.grad);
      EXPECT_LE(grad_error, lse_dtype == kFloat64 ? 1e-6 : 2e-3);
    }
  }
}

// The lse kept in float64 gives the gradient fp32's accuracy whatever the logits' offset:
// the kernels take e^(z - lse) as e^(z - fl32(lse)) times e^(fl32(lse) - lse), the factor in
// the per-row coefficient (GradientConstants). Offsets up to 1e9 (the logits' own spacing
// 0.25 at 3e6 and 64 at 1e9, so rows of ties there; the oracle takes the stored values; the
// float64 lse's own rounding, 2^-53 |lse|, is 1.1e-7 at 1e9), both signs, three uneven ranks (one of a
// single column), with label smoothing and with z-loss, on every SIMD target: loss and
// gradient within 1e-6 of the oracle. With a float32 lse the gradient's error at |offset| >=
// 1e4 is checked to exceed 1e-5 (2^-24 |lse| relative, about 1e-4 at 1e4): what float64 buys.
TEST(Adversarial, AFloat64LseKeepsTheGradientAtFp32sAccuracyForLogitsUpTo1e9) {
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    for (double offset : {0.0, 300.0, 1e4, -1e4, 1e5, 3e6, -1e9}) {
      for (int option = 0; option < 3; ++option) {  // plain, label smoothing 0.1, z-loss 1e-4
        const std::string where =
            variant.name + ", offset " + std::to_string(offset) + ", option " + std::to_string(option);
        Problem problem = random_problem(12, 1201, kFloat32, 61, 3.0f);
        for (int64_t i = 0; i < problem.tokens; ++i) {
          for (int64_t v = 0; v < problem.vocab; ++v) problem.set(i, v, static_cast<float>(problem.at(i, v) + offset));
        }
        RunOptions options;
        if (option == 1) options.loss.label_smoothing = 0.1f;
        if (option == 2) options.loss.z_loss_weight = 1e-4f;
        const RunResult result = run_ranks(problem, shards_from_sizes({600, 1, 600}), options);
        for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
        const reference::Result want = oracle(problem, options);
        EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6) << where;
        EXPECT_LE(relative_error(result.grad, want.grad), 1e-6) << where;
        if (std::fabs(offset) >= 1e4) {
          options.lse_dtype = kFloat32;
          const RunResult fp32_lse = run_ranks(problem, shards_from_sizes({600, 1, 600}), options);
          for (const Status& s : fp32_lse.status) ASSERT_TRUE(s.ok()) << s.to_string();
          EXPECT_GT(relative_error(fp32_lse.grad, want.grad), 1e-5) << where << ", float32 lse";
        }
      }
    }
  }
  use_best_simd_variant();
}

// Finite logits far beyond fp32's exp shift: |z log2(e)| past 2^27, where the AVX-512 lanes'
// shift c = fl32(s log2(e)) misses by up to 256 and 2^(z log2(e) - c) would leave fp32's range
// (a loss of -inf, NaN or a negative one, as a hostile review found at 5e9). On every SIMD
// target, in place and out of place, with the extras (the two-pass statistics) and without:
// every loss within 1e-6 of (m - z_t) + log(sum e^(z - m)) in fp64 (the oracle, which takes
// lse first and subtracts, loses 1e-4 to fp64's rounding at 1e12), and every gradient finite.
// The gradient is p = e^(z - lse) of the returned lse, float64 here, whose rounding there
// (2^-53 |lse|: 5e-7 at 5e9, 1e-4 at 1e12) bounds how well p can be known (design.md,
// "Precision"); it is checked against that closed form, in fp64 from the same lse. (Label smoothing is left out: its
// sum of the logits runs in fp32 lanes, so at such magnitudes it keeps its relative accuracy, not the loss's.)
TEST(Adversarial, LogitsBeyondTheExpShiftsFp32RangeStayFiniteOnEveryTarget) {
  constexpr int64_t kTokens = 6, kColumns = 300;
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    for (DataType dtype : {kFloat32, kBFloat16}) {
      for (int mode = 0; mode < 3; ++mode) {  // out of place, in place, with the extras
        Problem p = random_problem(kTokens, kColumns, dtype, 41, 1.0f);
        for (int64_t v = 0; v < kColumns; ++v) {
          p.set(0, v, 5e9f);                                             // uniform: the loss is log V
          p.set(1, v, v == 7 ? 8e9f : v == 8 ? 8e9f - 0x1p24f : -8e9f);  // two near the top
          p.set(2, v, v % 3 == 0 ? -3e10f : -3e10f - 0x1p25f);           // every logit negative and huge
          p.set(3, v, v == 0 ? 1e12f : 1e12f - 1e9f);                    // the target on top by 1e9
          p.set(4, v, v == 5 ? 3e38f : v % 2 == 0 ? -3e38f : 0.0f);      // z - s overflows to -inf
          p.set(5, v, 1.5e9f + static_cast<float>(v % 7) * 256.0f);      // just past the edge
        }
        p.targets = {3, 8, 4, 0, 5, 6};
        const std::vector<double> x = p.as_double();
        RunOptions options;
        options.in_place = mode == 1;
        options.extras = mode == 2;
        const RunResult result = run_ranks(p, shards_from_sizes({100, 200}), options);
        for (const Status& st : result.status) ASSERT_TRUE(st.ok()) << st.to_string();
        const std::string where = variant.name + " " + to_string(dtype) + " mode " + std::to_string(mode);
        std::vector<double> loss(static_cast<std::size_t>(kTokens)), grad(static_cast<std::size_t>(kTokens * kColumns));
        for (int64_t i = 0; i < kTokens; ++i) {
          const double* row = x.data() + i * kColumns;
          const double m = *std::max_element(row, row + kColumns);
          double sum = 0.0;
          for (int64_t v = 0; v < kColumns; ++v) sum += std::exp(row[v] - m);
          const int64_t target = p.targets[static_cast<std::size_t>(i)];
          loss[static_cast<std::size_t>(i)] = (m - row[target]) + std::log(sum);
          const double lse = result.per_rank[0].lse[static_cast<std::size_t>(i)];
          for (int64_t v = 0; v < kColumns; ++v) {
            grad[static_cast<std::size_t>(i * kColumns + v)] =
                p.grad_loss[static_cast<std::size_t>(i)] * (std::exp(row[v] - lse) - (v == target ? 1.0 : 0.0));
          }
        }
        EXPECT_LE(relative_error(widen(result.per_rank[0].loss), loss), 1e-6) << where;
        for (double g : result.grad) ASSERT_TRUE(std::isfinite(g)) << where;
        EXPECT_LE(relative_error(result.grad, grad), dtype == kFloat32 || mode != 1 ? 1e-5 : 8e-3) << where;
      }
    }
    // A NaN among such logits still reaches its token's loss (the rows that subtract first).
    Problem p = random_problem(3, kColumns, kFloat32, 43, 1.0f);
    for (int64_t v = 0; v < kColumns; ++v) {
      p.set(0, v, v == 150 ? std::numeric_limits<float>::quiet_NaN() : 5e9f);
      p.set(1, v, v == 0 ? std::numeric_limits<float>::quiet_NaN() : -3e10f);
      p.set(2, v, 8e9f);
    }
    p.targets = {1, 2, 3};
    const RunResult result = run_ranks(p, shards_from_sizes({100, 200}), RunOptions{});
    for (const Status& st : result.status) ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(std::isnan(result.per_rank[0].loss[0])) << variant.name;
    EXPECT_TRUE(std::isnan(result.per_rank[0].loss[1])) << variant.name;
    EXPECT_NEAR(result.per_rank[0].loss[2], std::log(static_cast<double>(kColumns)), 1e-6) << variant.name;
  }
  use_best_simd_variant();
}

// A target whose logit is -inf: the loss is +inf (the mathematics says so), the gradient finite.
TEST(Adversarial, TargetAtMinusInfinityGivesInfiniteLossFiniteGradient) {
  Problem problem = random_problem(2, 32, kFloat32, 8);
  problem.targets = {5, 20};
  problem.set(0, 5, -kInf);
  problem.set(1, 20, -kInf);
  const RunResult result = run_ranks(problem, shards_from_sizes({16, 16}), RunOptions{});
  for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(result.per_rank[0].loss[0], kInf);
  EXPECT_EQ(result.per_rank[1].loss[1], kInf);
  for (double g : result.grad) EXPECT_TRUE(std::isfinite(g));
}

// Soft-capped logits where tanh saturates (Gemma's cap of 30, logits of 3 to 6.5 caps): the
// slope 1 - tanh^2 taken from the rounded tanh lost the gradient's accuracy (7.5e-4 of the
// row's largest element); from expm1(2|a|) it keeps what the fp32 z allows (its rounding,
// 2^-24 |z| absolute, is in every p = exp(z - lse): 1.8e-6 relative at the cap of 30, as in
// any fp32 implementation), on every SIMD target, in and out of place, also with a logit
// scale.
TEST(Adversarial, SoftCappedGradientKeepsItsAccuracyWhereTanhSaturates) {
  constexpr int64_t kTokens = 64, kVocab = 70;
  Problem problem = random_problem(kTokens, kVocab, kFloat32, 31, 1.0f);
  for (int64_t i = 0; i < kTokens; ++i) {
    for (int64_t v = 0; v < kVocab; ++v) {
      // 3 to 6.5 caps (of 30), either sign: every logit where tanh saturates
      const double caps = 3.0 + 1.5 * std::fabs(problem.at(i, v));
      problem.set(i, v, static_cast<float>(30.0 * std::copysign(std::min(caps, 6.5), problem.at(i, v))));
    }
  }
  const std::vector<double> x = problem.as_double();
  for (float scale : {1.0f, 1.25f}) {
    for (const SimdVariant& variant : simd_variants()) {
      use_simd_variant(variant);
      for (bool in_place : {false, true}) {
        Problem copy = problem;
        RunOptions options;
        options.loss.softcap = 30.0f;
        options.loss.logit_scale = scale;
        options.in_place = in_place;
        const RunResult result = run_ranks(copy, shards_from_sizes({30, 40}), options);
        for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
        reference::Options o;
        o.softcap = 30.0;
        o.logit_scale = scale;
        const auto want =
            reference::cross_entropy(x, kTokens, kVocab, problem.targets, {}, widen(problem.grad_loss), o);
        EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6)
            << variant.name << " scale " << scale;
        double worst = 0.0;  // row by row: a row's gradient is as small as its slopes
        for (int64_t i = 0; i < kTokens; ++i) {
          const auto row = [&](const std::vector<double>& g) {
            return std::vector<double>(g.begin() + i * kVocab, g.begin() + (i + 1) * kVocab);
          };
          worst = std::max(worst, relative_error(row(result.grad), row(want.grad)));
        }
        EXPECT_LE(worst, 1e-6 + 0x1p-23 * 30.0)  // z's rounding at the cap
            << variant.name << " scale " << scale << (in_place ? " in place" : "");
      }
    }
  }
  use_best_simd_variant();
}

// Very confident tokens (the target 25-60 above every other logit: a loss of 1e-11 down to
// 1e-26): the sums' roundings took 15 % of such tokens' loss and entropy a rounding below 0.
// Both are >= 0, with and without smoothing and extras, over one and two ranks.
TEST(Adversarial, VeryConfidentTokensHaveNoNegativeLossOrEntropy) {
  constexpr int64_t kTokens = 3000, kVocab = 48;
  Problem problem = random_problem(kTokens, kVocab, kFloat32, 21, 1.0f);
  for (int64_t i = 0; i < kTokens; ++i) {
    double top = -kInf;
    for (int64_t v = 0; v < kVocab; ++v) top = std::max(top, problem.at(i, v));
    problem.set(i, problem.targets[static_cast<std::size_t>(i)], static_cast<float>(top + 25.0 + (i % 36)));
  }
  for (float smoothing : {0.0f, 0.1f}) {
    for (const auto& shards : {shards_from_sizes({kVocab}), shards_from_sizes({20, 28})}) {
      RunOptions options;
      options.loss.label_smoothing = smoothing;
      options.extras = true;
      const RunResult result = run_ranks(problem, shards, options);
      for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
      int negative = 0;
      for (int64_t i = 0; i < kTokens; ++i) {
        const auto k = static_cast<std::size_t>(i);
        negative += result.per_rank[0].loss[k] < 0.0f || result.per_rank[0].entropy[k] < 0.0f;
      }
      EXPECT_EQ(negative, 0) << "smoothing " << smoothing << ", " << shards.size() << " ranks";
    }
  }
}

// Rows long enough for several of the forward's chunks (256 vectors: 4096 columns on
// AVX-512, 2048 on AVX2) and two blocks, whose max grows from chunk to chunk (so the running
// sum is rescaled, by up to e^-205), sits in the last chunk far above the rest, sits in the
// first, or follows chunks of -inf; on every SIMD target, with and without label smoothing.
TEST(Adversarial, MaxMovingAcrossChunksMatchesOracle) {
  constexpr int64_t kTokens = 7, kColumns = 20480;
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    for (DataType dtype : {kFloat32, kBFloat16}) {
      for (float smoothing : {0.0f, 0.1f}) {
        Problem p = random_problem(kTokens, kColumns, dtype, 31, 1.0f);
        for (int64_t v = 0; v < kColumns; ++v) {
          const auto x = static_cast<float>(v);
          p.set(0, v, x * 0.01f);                                  // rising slowly: a new max in every chunk
          p.set(1, v, x * 0.05f - 100.0f);                         // rising fast: rescaled by up to e^-205
          p.set(2, v, v == kColumns - 3 ? 90.0f : p.at(2, v));     // the max 90 above the rest, at the end
          p.set(3, v, v == 2 ? 40.0f : p.at(3, v));                // the max in the first chunk
          p.set(4, v, 20.0f - x * 0.01f);                          // falling
          if (smoothing == 0.0f && v < 10000) p.set(5, v, -kInf);  // chunks of -inf, then values
          if (smoothing == 0.0f && v >= 4096 && v < 12400) p.set(6, v, -kInf);  // values, -inf, values
        }
        p.targets = {kColumns - 1, 10, kColumns - 3, 2, 0, 10600, 13500};
        const std::vector<double> x = p.as_double();
        RunOptions options;
        options.loss.label_smoothing = smoothing;
        const RunResult result = run_ranks(p, shards_from_sizes({kColumns}), options);
        for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
        const auto want = reference::cross_entropy(x, kTokens, kColumns, p.targets, smoothing, widen(p.grad_loss));
        const std::string where = variant.name + " " + to_string(dtype) + " smoothing " + std::to_string(smoothing);
        EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6) << where;
        EXPECT_LE(relative_error(widen(result.per_rank[0].lse), want.lse), 1e-6) << where;
        EXPECT_LE(relative_error(result.grad, want.grad), 1e-6) << where;
      }
    }
  }
  use_best_simd_variant();
}

// Label smoothing where every logit is large and they sit close together (1e3 to 1e7, give
// or take a few units; +-1e4 is the classic adversarial row): the smoothed loss needs the
// mean of the logits, which the statistics carry relative to each rank's max (as a plain
// fp32 sum of z it lost 5e-6 at 1e4 and 3e-4 at 1e6). Rows of two blocks and several
// chunks, one with a max that grows chunk after chunk, a row of -inf columns (an infinite
// smoothed loss), uneven ranks (one of a single column), one call and staged, with and
// without the extras (the two-pass statistics), both semantics, on every SIMD target.
TEST(Adversarial, SmoothingWithLargeCloseTogetherLogitsKeepsItsAccuracy) {
  constexpr int64_t kTokens = 7, kColumns = 20000;
  const float offsets[] = {1e3f, 1e4f, -1e4f, 1e5f, 1e6f, 1e7f, 1e4f};
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    Problem p = random_problem(kTokens, kColumns, kFloat32, 51, 3.0f);
    for (int64_t i = 0; i < kTokens; ++i) {
      for (int64_t v = 0; v < kColumns; ++v) {
        const float rise = i == 3 ? static_cast<float>(v) * 1e-3f : 0.0f;  // a new max in every chunk
        p.set(i, v, offsets[i] + p.at(i, v) + rise);
      }
    }
    p.set(6, 11, -kInf);
    p.set(6, 15000, -kInf);
    const std::vector<double> x = p.as_double();
    for (const auto& sizes : std::vector<std::vector<int64_t>>{{kColumns}, {7000, 13000}, {3000, 9000, 1, 7999}}) {
      for (int mode = 0; mode < 3; ++mode) {  // one call, staged, with the extras
        for (SmoothingSemantics semantics : {SmoothingSemantics::kMegatron, SmoothingSemantics::kPyTorch}) {
          RunOptions options;
          options.loss.label_smoothing = 0.1f;
          options.loss.smoothing_semantics = semantics;
          options.staged = mode == 1;
          options.extras = mode == 2;
          const RunResult result = run_ranks(p, shards_from_sizes(sizes), options);
          for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
          const auto want = oracle(p, options);
          const std::string where = variant.name + " ranks " + std::to_string(sizes.size()) + " mode " +
                                    std::to_string(mode) + " semantics " + std::to_string(static_cast<int>(semantics));
          std::vector<double> loss = widen(result.per_rank[0].loss), want_loss = want.loss;
          EXPECT_EQ(loss[6], kInf) << where;  // -inf columns: log p = -inf, smoothed
          EXPECT_EQ(want_loss[6], kInf) << where;
          loss.pop_back();
          want_loss.pop_back();
          for (std::size_t i = 0; i < loss.size(); ++i) {
            EXPECT_LE(std::fabs(loss[i] - want_loss[i]), 1e-6 * std::fabs(want_loss[i])) << where << " token " << i;
          }
        }
      }
    }
    // One huge logit among ordinary ones (up to 1e38): the offsets from the max are huge
    // too, and (half) their mean, not their sum (32000 x -1e35 is beyond fp32), travels; the
    // lanes keep their sums scaled by 2^-32. The target on the huge logit or not.
    // And rows whose logits span beyond fp32's range (3e38 and -3e38: offsets of -6e38,
    // whose half-mean is what travels).
    Problem q = random_problem(6, kColumns, kFloat32, 53, 1.0f);
    const float huge[] = {1e34f, 1e36f, 1e38f, 1e36f};
    for (int64_t i = 0; i < 4; ++i) q.set(i, 4444 + i, huge[i]);
    for (int64_t v = 0; v < kColumns; ++v) {
      q.set(4, v, v == 9 ? 3e38f : v % 2 == 0 ? -3e38f : 0.0f);
      q.set(5, v, v < 9000 ? 3e38f - static_cast<float>(v % 5) * 1e31f : -3e38f);  // one rank near the top
    }
    q.targets = {4444, 4445, 4446, 17, 9, 3};
    const std::vector<double> xq = q.as_double();
    for (const auto& sizes : std::vector<std::vector<int64_t>>{{kColumns}, {7000, 13000}}) {
      for (int mode = 0; mode < 3; ++mode) {
        RunOptions options;
        options.loss.label_smoothing = 0.1f;
        options.staged = mode == 1;
        options.extras = mode == 2;
        const RunResult result = run_ranks(q, shards_from_sizes(sizes), options);
        for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
        const auto want = oracle(q, options);
        for (std::size_t i = 0; i < 6; ++i) {
          const double got = result.per_rank[0].loss[i];
          EXPECT_LE(std::fabs(got - want.loss[i]), 1e-6 * std::fabs(want.loss[i]))
              << variant.name << " huge logit, ranks " << sizes.size() << " mode " << mode << " token " << i;
        }
      }
    }
  }
  use_best_simd_variant();
}

// A NaN logit anywhere among the valid columns makes that token's loss NaN, on every target,
// with and without the extras (two-pass statistics), whether or not the NaN lands in the max,
// whatever its sign and payload (the forward over 16-bit logits adds 2^n to e^r's exponent
// bits, which a NaN must survive), with and without a logit scale; the other tokens stay exact.
TEST(Adversarial, NanLogitMakesItsTokenNanOnEveryTarget) {
  constexpr int64_t kTokens = 5, kColumns = 3000;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float payload_nan = std::bit_cast<float>(0xFFFFFFFFu);  // negative, every payload bit set
  const float signalling_nan = std::bit_cast<float>(0x7F810001u);
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    for (DataType dtype : {kFloat32, kBFloat16, kFloat16}) {
      for (bool extras : {false, true}) {
        Problem p = random_problem(kTokens, kColumns, dtype, 41, 1.0f);
        p.targets = {7, 8, 9, 10, 11};
        p.set(0, 1234, nan);          // mid-row, in the first rank's shard
        p.set(1, kColumns - 1, nan);  // the last column: a partial vector
        p.set(2, 0, payload_nan);     // the first column, before any max
        p.set(2, 17, signalling_nan);
        p.set(3, 2000, signalling_nan);  // the second rank's shard, after the max
        p.set(3, 2001, 50.0f);
        const std::vector<double> x = p.as_double();
        RunOptions options;
        options.extras = extras;
        options.loss.logit_scale = extras ? 1.0f : 0.75f;
        const RunResult result = run_ranks(p, shards_from_sizes({1500, 1500}), options);
        for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
        const std::string where = variant.name + " " + to_string(dtype) + (extras ? " extras" : "");
        for (int64_t i = 0; i < 4; ++i) EXPECT_TRUE(std::isnan(result.per_rank[0].loss[i])) << where << ", token " << i;
        reference::Options scaled;
        scaled.logit_scale = options.loss.logit_scale;
        const auto want = reference::cross_entropy(std::vector<double>(x.end() - kColumns, x.end()), 1, kColumns,
                                                   {p.targets[4]}, {}, {1.0}, scaled);
        EXPECT_NEAR(result.per_rank[0].loss[4], want.loss[0], 1e-6 * want.loss[0]) << where;
      }
    }
  }
  use_best_simd_variant();
}

// NaN as whole vectors, chunks, rows and shards (the tester's cases: the last 16 of 1072
// columns, the last 16 of 48, a rank's whole shard; chunks of 64 and of 256 vectors, the
// forward's on AVX-512 and AVX2 now; every column),
// on every target, fp32 and bf16, with and without the extras, one rank and two: the token's
// loss and lse are NaN, as PyTorch and the oracle give; the other tokens stay exact. (A
// chunk whose every element is NaN or -inf has max -inf, and was once taken for empty.)
TEST(Adversarial, NanVectorsChunksRowsAndShardsReachTheLoss) {
  struct Span {
    int64_t vocab, begin, end;  // NaN in columns [begin, end) of token 0's row
    bool with_minus_inf;        // and -inf in the rest of that shard's columns
  };
  const Span spans[] = {{1072, 1056, 1072, false}, {48, 32, 48, false},          {48, 24, 48, false},
                        {2048, 1024, 2048, false}, {3000, 1000, 2024, false},    {64, 0, 64, false},
                        {64, 32, 64, true},        {20000, 16384, 16400, false}, {12288, 4096, 8192, false},
                        {12288, 8192, 12288, true}};
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    for (const Span& span : spans) {
      for (DataType dtype : {kFloat32, kBFloat16}) {
        for (bool extras : {false, true}) {
          for (int ranks : {1, 2}) {
            Problem p = nan_span_problem(span.vocab, span.begin, span.end, span.with_minus_inf, dtype, 1.0f);
            const std::vector<double> x = p.as_double();
            RunOptions options;
            options.extras = extras;
            const RunResult result = run_ranks(p, shards_from_sizes(even_splits(span.vocab, ranks)), options);
            for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
            const std::string where = variant.name + " " + to_string(dtype) + " V " + std::to_string(span.vocab) +
                                      " NaN [" + std::to_string(span.begin) + ", " + std::to_string(span.end) + ") R " +
                                      std::to_string(ranks) + (extras ? " extras" : "");
            for (int r = 0; r < ranks; ++r) {
              EXPECT_TRUE(std::isnan(result.per_rank[r].loss[0])) << where << ", rank " << r;
              EXPECT_TRUE(std::isnan(result.per_rank[r].lse[0])) << where << ", rank " << r;
            }
            for (int64_t v = 0; v < span.vocab; ++v) {
              ASSERT_TRUE(std::isnan(result.grad[static_cast<size_t>(v)])) << where << ", column " << v;
            }
            const auto want = reference::cross_entropy(std::vector<double>(x.begin() + span.vocab, x.end()), 1,
                                                       span.vocab, {p.targets[1]}, 0.0, {1.0});
            EXPECT_NEAR(result.per_rank[0].loss[1], want.loss[0], 1e-6 * want.loss[0]) << where;
          }
        }
      }
    }
  }
  use_best_simd_variant();
}

// A NaN or infinite upstream gradient (the tensor autograd hands the backward) is data, not an
// argument: as in PyTorch, it reaches its own token's gradient row and no other. Token 1's NaN
// makes its row NaN; token 4's +inf and token 5's -inf make their rows non-finite (inf times
// p - onehot, NaN where an implementation meets inf - inf, as PyTorch's does at the target);
// the other rows match the oracle. A reduced loss's NaN scalar makes every element NaN.
// Every target, fp32 and bf16, in place and out of place, two uneven ranks.
TEST(Adversarial, NonFiniteUpstreamGradientsReachOnlyTheirTokensRows) {
  constexpr int64_t kTokens = 6, kColumns = 300;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    for (DataType dtype : {kFloat32, kBFloat16}) {
      for (bool in_place : {false, true}) {
        Problem p = random_problem(kTokens, kColumns, dtype, 61, 2.0f);
        const std::vector<double> x = p.as_double();
        std::vector<double> finite_upstream = widen(p.grad_loss);
        finite_upstream[1] = finite_upstream[4] = finite_upstream[5] = 1.0;
        const auto want = reference::cross_entropy(x, kTokens, kColumns, p.targets, 0.0, finite_upstream);
        p.grad_loss[1] = nan;
        p.grad_loss[4] = kInf;
        p.grad_loss[5] = -kInf;
        RunOptions options;
        options.in_place = in_place;
        const RunResult result = run_ranks(p, shards_from_sizes({110, 190}), options);
        for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
        const std::string where = variant.name + " " + to_string(dtype) + (in_place ? " in place" : "");
        // The other rows: within 1e-6 of the largest element, plus one bf16 ulp of each element
        // (2^-7 relative at most) where the gradient is written in place in bf16.
        const double rounding = in_place && dtype == kBFloat16 ? 0x1p-7 : 0.0;
        double largest = 0.0, off = 0.0;
        for (int64_t i = 0; i < kTokens; ++i) {
          for (int64_t v = 0; v < kColumns; ++v) {
            const double got = result.grad[static_cast<size_t>(i * kColumns + v)];
            const double exact = want.grad[static_cast<size_t>(i * kColumns + v)];
            if (i == 1) {
              ASSERT_TRUE(std::isnan(got)) << where << ", column " << v;
            } else if (i >= 4) {
              ASSERT_FALSE(std::isfinite(got)) << where << ", token " << i << ", column " << v;
            } else {
              largest = std::max(largest, std::fabs(exact));
              off = std::max(off, std::fabs(got - exact) - rounding * std::fabs(exact));
            }
          }
        }
        EXPECT_LE(off, 1e-6 * largest) << where;
        EXPECT_TRUE(std::isfinite(result.per_rank[0].loss[1])) << where;  // the forward never saw it
      }
    }
    // A NaN upstream gradient of a summed loss: every element NaN.
    Problem p = random_problem(kTokens, kColumns, kFloat32, 62, 2.0f);
    RunOptions options;
    options.loss.reduction = Reduction::kSum;
    options.grad_scalar = nan;
    const RunResult result = run_ranks(p, shards_from_sizes({110, 190}), options);
    for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
    for (double g : result.grad) ASSERT_TRUE(std::isnan(g)) << variant.name;
  }
  use_best_simd_variant();
}

}  // namespace
}  // namespace vpce::test
