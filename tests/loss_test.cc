// tests/loss_test.cc: vpce's forward and backward on R in-process ranks against the fp64
// oracle, on fresh random inputs, over dtype x R x V x tokens x in-place x label smoothing,
// through the one-call and the staged API.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "reference/reference.h"
#include "support.h"

namespace vpce::test {
namespace {

struct Case {
  DataType dtype;
  int ranks;
  int64_t vocab;
  int64_t tokens;
  bool in_place;
  float smoothing;
  bool staged;
};

std::string dtype_name(DataType d) { return d == kFloat32 ? "fp32" : d == kBFloat16 ? "bf16" : "fp16"; }

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return dtype_name(c.dtype) + "_R" + std::to_string(c.ranks) + "_V" + std::to_string(c.vocab) + "_N" +
         std::to_string(c.tokens) + (c.in_place ? "_inplace" : "_outofplace") + (c.smoothing > 0 ? "_smooth" : "") +
         (c.staged ? "_staged" : "");
}

// Unit roundoff of a dtype: the largest relative error of rounding to it.
double unit_roundoff(DataType d) { return d == kFloat32 ? 0x1p-24 : d == kBFloat16 ? 0x1p-8 : 0x1p-11; }

// Every element of `got` is within rounding to `dtype` of the oracle, plus 1e-6 of the
// largest value (the fp32 math).
void expect_within_rounding(const std::vector<double>& got, const std::vector<double>& want, DataType dtype,
                            const char* what) {
  double scale = 0.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  int bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double tolerance = unit_roundoff(dtype) * std::fabs(want[i]) + 1e-6 * scale;
    if (!(std::fabs(got[i] - want[i]) <= tolerance) && bad++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", oracle " << want[i] << ", tolerance " << tolerance;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": elements outside tolerance";
}

class LossVsOracle : public testing::TestWithParam<Case> {};

TEST_P(LossVsOracle, MatchesFp64OracleAndRanksAgreeBitwise) {
  const Case c = GetParam();
  Problem problem = random_problem(c.tokens, c.vocab, c.dtype, 1000u * c.ranks + c.vocab + c.tokens);
  const std::vector<double> x = problem.as_double();  // the values vpce sees, exactly
  RunOptions options;
  options.loss.label_smoothing = c.smoothing;
  options.loss.num_threads = 2;
  options.in_place = c.in_place;
  options.staged = c.staged;
  const RunResult result = run_ranks(problem, shards_from_sizes(even_splits(c.vocab, c.ranks)), options);
  for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();

  const reference::Result want =
      reference::cross_entropy(x, c.tokens, c.vocab, problem.targets, c.smoothing, widen(problem.grad_loss));
  for (int r = 1; r < c.ranks; ++r) {
    EXPECT_EQ(0, std::memcmp(result.per_rank[0].loss.data(), result.per_rank[static_cast<size_t>(r)].loss.data(),
                             sizeof(float) * static_cast<size_t>(c.tokens)))
        << "rank " << r << "'s loss differs from rank 0's";
    EXPECT_EQ(0, std::memcmp(result.per_rank[0].lse.data(), result.per_rank[static_cast<size_t>(r)].lse.data(),
                             sizeof(float) * static_cast<size_t>(c.tokens)));
  }
  EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6);
  EXPECT_LE(relative_error(widen(result.per_rank[0].lse), want.lse), 1e-6);
  if (c.in_place) {
    expect_within_rounding(result.grad, want.grad, c.dtype, "grad (in place)");
  } else {
    EXPECT_LE(relative_error(result.grad, want.grad), 1e-6);
  }
}

std::vector<Case> sweep() {
  std::vector<Case> cases;
  for (DataType dtype : {kFloat32, kBFloat16, kFloat16}) {
    for (int ranks : {1, 2, 3, 4, 8}) {
      for (int64_t vocab : {int64_t{8}, int64_t{1000}, int64_t{4099}}) {  // 8/8: one column each
        for (int64_t tokens : {int64_t{1}, int64_t{37}}) {
          for (bool in_place : {false, true}) {
            for (float smoothing : {0.0f, 0.1f}) {
              cases.push_back({dtype, ranks, vocab, tokens, in_place, smoothing, false});
            }
          }
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sweep, LossVsOracle, testing::ValuesIn(sweep()), case_name);

// The bars' sizes: V = 32000 and V = 128256 / 4 per rank, R in {1, 2, 4}.
std::vector<Case> large() {
  std::vector<Case> cases;
  for (DataType dtype : {kFloat32, kBFloat16}) {
    for (int ranks : {1, 2, 4}) {
      for (float smoothing : {0.0f, 0.1f}) {
        cases.push_back({dtype, ranks, 32000, 16, false, smoothing, false});
        cases.push_back({dtype, ranks, 128256, 8, true, smoothing, false});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Large, LossVsOracle, testing::ValuesIn(large()), case_name);

std::vector<Case> staged() {
  std::vector<Case> cases;
  for (DataType dtype : {kFloat32, kBFloat16, kFloat16}) {
    for (int ranks : {1, 3, 4}) {
      for (bool in_place : {false, true}) {
        cases.push_back({dtype, ranks, 1001, 19, in_place, 0.1f, true});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Staged, LossVsOracle, testing::ValuesIn(staged()), case_name);

// The one-call and the staged paths run the same kernels in the same order: same bits.
TEST(StagedApi, BitIdenticalToOneCall) {
  for (int ranks : {1, 3}) {
    Problem a = random_problem(23, 777, kBFloat16, 5);
    Problem b = a;
    RunOptions options;
    options.loss.label_smoothing = 0.2f;
    const auto shards = shards_from_sizes(even_splits(777, ranks));
    const RunResult one_call = run_ranks(a, shards, options);
    options.staged = true;
    const RunResult stage_by_stage = run_ranks(b, shards, options);
    EXPECT_EQ(one_call.per_rank[0].loss, stage_by_stage.per_rank[0].loss);
    EXPECT_EQ(one_call.per_rank[0].lse, stage_by_stage.per_rank[0].lse);
    EXPECT_EQ(one_call.grad, stage_by_stage.grad);
  }
}

// Uneven shards, including empty ones and one-column ones.
TEST(UnevenShards, MatchOracle) {
  const std::vector<std::vector<int64_t>> splits = {{1, 999}, {500, 0, 500}, {1, 1, 1, 997}, {0, 1000}, {333, 1, 666}};
  for (const auto& sizes : splits) {
    Problem problem = random_problem(29, 1000, kFloat32, sizes.size() * 7 + static_cast<uint64_t>(sizes[0]));
    RunOptions options;
    options.loss.label_smoothing = 0.1f;
    const RunResult result = run_ranks(problem, shards_from_sizes(sizes), options);
    for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
    const auto want =
        reference::cross_entropy(problem.as_double(), 29, 1000, problem.targets, 0.1, widen(problem.grad_loss));
    EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6);
    EXPECT_LE(relative_error(result.grad, want.grad), 1e-6);
  }
}

// The bar: label smoothing 0.1 with R = 4 equals R = 1 within 1e-6, on every rank.
TEST(LabelSmoothing, FourRanksEqualOneRank) {
  Problem one = random_problem(64, 32000, kFloat32, 77);
  Problem four = one;
  RunOptions options;
  options.loss.label_smoothing = 0.1f;
  const RunResult r1 = run_ranks(one, shards_from_sizes({32000}), options);
  const RunResult r4 = run_ranks(four, shards_from_sizes(even_splits(32000, 4)), options);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(r4.per_rank[static_cast<size_t>(r)].loss, r4.per_rank[0].loss);
    EXPECT_LE(relative_error(widen(r4.per_rank[static_cast<size_t>(r)].loss), widen(r1.per_rank[0].loss)), 1e-6);
  }
  EXPECT_LE(relative_error(r4.grad, r1.grad), 1e-6);
}

// Results do not depend on the number of threads, nor on in place versus out of place.
TEST(Determinism, IndependentOfThreadCountAndPlacement) {
  Problem base = random_problem(61, 3001, kFloat32, 9);
  std::vector<RunResult> results;
  for (int threads : {1, 2, 3, 7}) {
    for (bool in_place : {false, true}) {
      Problem p = base;
      RunOptions options;
      options.loss.label_smoothing = 0.1f;
      options.loss.num_threads = threads;
      options.in_place = in_place;
      results.push_back(run_ranks(p, shards_from_sizes(even_splits(3001, 3)), options));
    }
  }
  for (const RunResult& r : results) {
    EXPECT_EQ(r.per_rank[0].loss, results[0].per_rank[0].loss);
    EXPECT_EQ(r.per_rank[0].lse, results[0].per_rank[0].lse);
    EXPECT_EQ(r.grad, results[0].grad);
  }
}

// The gradient against central finite differences of the fp64 loss, in fp32.
TEST(FiniteDifferences, GradientMatches) {
  for (float smoothing : {0.0f, 0.15f}) {
    Problem problem = random_problem(5, 40, kFloat32, 3, 1.5f);
    std::fill(problem.grad_loss.begin(), problem.grad_loss.end(), 1.0f);
    const std::vector<double> x = problem.as_double();
    RunOptions options;
    options.loss.label_smoothing = smoothing;
    const RunResult result = run_ranks(problem, shards_from_sizes({13, 27}), options);
    for (int64_t i = 0; i < 5; ++i) {
      std::vector<double> row(x.begin() + i * 40, x.begin() + (i + 1) * 40);
      for (int64_t v = 0; v < 40; ++v) {
        const double h = 1e-5;
        std::vector<double> plus = row, minus = row;
        plus[static_cast<size_t>(v)] += h;
        minus[static_cast<size_t>(v)] -= h;
        reference::Options megatron;
        megatron.label_smoothing = smoothing;
        const int64_t y = problem.targets[static_cast<size_t>(i)];
        const double fd = (reference::token_loss(plus.data(), 40, y, megatron) -
                           reference::token_loss(minus.data(), 40, y, megatron)) /
                          (2 * h);
        EXPECT_NEAR(result.grad[static_cast<size_t>(i * 40 + v)], fd, 2e-6) << "token " << i << " column " << v;
      }
    }
  }
}

}  // namespace
}  // namespace vpce::test
