// tests/options_test.cc: every loss option, alone and in every pair, against the fp64
// oracle for R in {1, 2, 4}: ignore_index, per-token weights, sum and mean reductions, both
// label-smoothing semantics, z-loss, logit scale, soft-cap, padded vocabulary, and the
// argmax / entropy extras; the same loss on every rank; all tokens ignored.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "support.h"

namespace vpce::test {
namespace {

constexpr int64_t kTokens = 33;
constexpr int64_t kVocab = 1003;

struct Option {
  const char* name;
  std::function<void(RunOptions&, Problem&)> apply;
};

// In an order where each option's change to the targets survives the later ones.
const std::vector<Option>& all_options() {
  static const std::vector<Option> options = {
      {"padded",
       [](RunOptions& o, Problem& p) {
         o.loss.valid_vocab_size = kVocab - 7;  // the padding spans a shard boundary for R = 4 only at the end
         for (int64_t& y : p.targets) y %= kVocab - 7;
         for (int64_t i = 0; i < p.tokens; ++i) {
           for (int64_t v = kVocab - 7; v < kVocab; ++v) p.set(i, v, 30.0f);  // would dominate if it leaked
         }
       }},
      {"ignore",
       [](RunOptions& o, Problem& p) {
         o.loss.ignore_index = -100;
         for (std::size_t i = 1; i < p.targets.size(); i += 4) p.targets[i] = -100;
       }},
      {"weights",
       [](RunOptions& o, Problem& p) {
         o.weights.resize(static_cast<std::size_t>(p.tokens));
         for (std::size_t i = 0; i < o.weights.size(); ++i)
           o.weights[i] = i % 5 == 2 ? 0.0f : 0.25f * static_cast<float>(i % 7);
       }},
      {"sum",
       [](RunOptions& o, Problem&) {
         o.loss.reduction = Reduction::kSum;
         o.grad_scalar = 0.7f;
       }},
      {"mean",
       [](RunOptions& o, Problem&) {
         o.loss.reduction = Reduction::kMean;
         o.grad_scalar = 1.3f;
       }},
      {"megatron_smoothing", [](RunOptions& o, Problem&) { o.loss.label_smoothing = 0.1f; }},
      {"pytorch_smoothing",
       [](RunOptions& o, Problem&) {
         o.loss.label_smoothing = 0.2f;
         o.loss.smoothing_semantics = SmoothingSemantics::kPyTorch;
       }},
      {"z_loss", [](RunOptions& o, Problem&) { o.loss.z_loss_weight = 0.01f; }},
      {"logit_scale", [](RunOptions& o, Problem&) { o.loss.logit_scale = 0.6f; }},
      {"softcap", [](RunOptions& o, Problem&) { o.loss.softcap = 4.0f; }},
      {"extras", [](RunOptions& o, Problem&) { o.extras = true; }},
  };
  return options;
}

bool compatible(const std::string& a, const std::string& b) {
  return !((a == "sum" && b == "mean") || (a == "megatron_smoothing" && b == "pytorch_smoothing"));
}

struct Case {
  std::vector<int> options;  // indices into all_options()
  int ranks;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  std::string name;
  for (int o : info.param.options) name += std::string(all_options()[static_cast<size_t>(o)].name) + "_";
  return name + "R" + std::to_string(info.param.ranks);
}

void expect_matches_oracle(Problem& problem, const RunOptions& options, int ranks, bool check_ranks_agree = true) {
  const RunResult result = run_ranks(problem, shards_from_sizes(even_splits(problem.vocab, ranks)), options);
  for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
  Problem original = problem;  // the oracle needs the logits before an in-place gradient
  const reference::Result want = oracle(problem, options);
  const RankOutputs& got = result.per_rank[0];
  if (check_ranks_agree) {
    for (const RankOutputs& other : result.per_rank) {
      EXPECT_EQ(0, std::memcmp(other.loss.data(), got.loss.data(), got.loss.size() * sizeof(float)))
          << "ranks return different losses";
    }
  }
  EXPECT_LE(relative_error(widen(got.loss), want.loss), 1e-6);
  EXPECT_LE(relative_error(widen(got.lse), want.lse), 1e-6);
  EXPECT_LE(relative_error(result.grad, want.grad), 1e-6);
  for (double g : result.grad) ASSERT_TRUE(std::isfinite(g));
  if (options.extras) {
    EXPECT_LE(relative_error(widen(got.entropy), want.entropy), 1e-6);
    int near_ties = 0;
    for (std::size_t i = 0; i < want.target_is_argmax.size(); ++i) {
      if (want.top_gap[i] < 1e-5) {  // within fp32 rounding of a tie: either answer is right
        ++near_ties;
        continue;
      }
      EXPECT_EQ(got.target_is_argmax[i], want.target_is_argmax[i]) << "token " << i;
    }
    EXPECT_LE(near_ties, 2);
  }
}

class OptionsVsOracle : public testing::TestWithParam<Case> {};

TEST_P(OptionsVsOracle, LossGradientAndExtrasMatchOracle) {
  const Case& c = GetParam();
  Problem problem = random_problem(kTokens, kVocab, kFloat32, 100 + c.options[0] * 13 + c.options.back());
  // Make some targets the argmax, so that target_is_argmax is not always 0.
  for (int64_t i = 0; i < kTokens; i += 3) problem.set(i, problem.targets[static_cast<size_t>(i)], 15.0f);
  RunOptions options;
  options.loss.num_threads = 2;
  for (int o : c.options) all_options()[static_cast<size_t>(o)].apply(options, problem);
  expect_matches_oracle(problem, options, c.ranks);
}

std::vector<Case> singles_and_pairs() {
  std::vector<Case> cases;
  const int count = static_cast<int>(all_options().size());
  for (int ranks : {1, 2, 4}) {
    for (int a = 0; a < count; ++a) {
      cases.push_back({{a}, ranks});
      for (int b = a + 1; b < count; ++b) {
        if (compatible(all_options()[static_cast<size_t>(a)].name, all_options()[static_cast<size_t>(b)].name)) {
          cases.push_back({{a, b}, ranks});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(SinglesAndPairs, OptionsVsOracle, testing::ValuesIn(singles_and_pairs()), case_name);

// Everything at once, through the staged API, in place, in bf16 and fp16.
TEST(Options, AllTogetherStagedInPlaceLowPrecision) {
  for (DataType dtype : {kBFloat16, kFloat16}) {
    Problem problem = random_problem(kTokens, kVocab, dtype, 7);
    RunOptions options;
    for (const Option& o : all_options()) {
      if (std::string(o.name) != "sum" && std::string(o.name) != "megatron_smoothing") o.apply(options, problem);
    }
    options.staged = true;
    const std::vector<double> x = problem.as_double();
    const RunResult result = run_ranks(problem, shards_from_sizes({100, 0, 503, 400}), options);
    for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
    // The oracle on the same (rounded) values; the fp32 gradient is then rounded once.
    Problem same = random_problem(kTokens, kVocab, dtype, 7);
    RunOptions same_options;
    for (const Option& o : all_options()) {
      if (std::string(o.name) != "sum" && std::string(o.name) != "megatron_smoothing") o.apply(same_options, same);
    }
    const reference::Result want = oracle(same, same_options);
    EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6);
    EXPECT_LE(relative_error(result.grad, want.grad), 1e-6);
  }
}

// Padding columns take no part, even when a whole shard is padding and with soft-capping.
TEST(Options, PaddingShardGetsZeroGradient) {
  Problem problem = random_problem(9, 64, kFloat32, 3);
  RunOptions options;
  options.loss.valid_vocab_size = 40;
  options.loss.softcap = 5.0f;
  for (int64_t& y : problem.targets) y %= 40;
  for (int64_t i = 0; i < 9; ++i) {
    for (int64_t v = 40; v < 64; ++v) problem.set(i, v, 1e4f);
  }
  const RunResult result = run_ranks(problem, shards_from_sizes({20, 20, 24}), options);
  for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
  for (int64_t i = 0; i < 9; ++i) {
    for (int64_t v = 40; v < 64; ++v) EXPECT_EQ(result.grad[static_cast<size_t>(i * 64 + v)], 0.0);
  }
  Problem fresh = random_problem(9, 64, kFloat32, 3);
  for (int64_t& y : fresh.targets) y %= 40;
  for (int64_t i = 0; i < 9; ++i) {
    for (int64_t v = 40; v < 64; ++v) fresh.set(i, v, 1e4f);
  }
  EXPECT_LE(relative_error(widen(result.per_rank[0].loss), oracle(fresh, options).loss), 1e-6);
}

// Every token ignored: a finite loss (0) for every reduction, and a zero gradient.
TEST(Options, EveryTokenIgnored) {
  for (Reduction reduction : {Reduction::kNone, Reduction::kSum, Reduction::kMean}) {
    Problem problem = random_problem(6, 50, kFloat32, 4);
    for (int64_t& y : problem.targets) y = -100;
    RunOptions options;
    options.loss.reduction = reduction;
    options.loss.label_smoothing = 0.1f;
    options.loss.z_loss_weight = 0.1f;
    options.extras = true;
    const RunResult result = run_ranks(problem, shards_from_sizes({25, 25}), options);
    for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
    for (float l : result.per_rank[0].loss) EXPECT_EQ(l, 0.0f);
    for (float a : result.per_rank[0].target_is_argmax) EXPECT_EQ(a, 0.0f);
    for (float l : result.per_rank[0].lse) EXPECT_TRUE(std::isfinite(l));
    for (double g : result.grad) EXPECT_EQ(g, 0.0);
  }
}

// PyTorch's semantics take label smoothing 1, as F.cross_entropy does (the target's weight 0,
// the uniform one 1): against the oracle over uneven ranks, in place and out; 1 stays refused
// with Megatron's semantics, and more than 1 with either.
TEST(Options, PyTorchSmoothingOfOne) {
  for (bool in_place : {false, true}) {
    Problem problem = random_problem(9, 70, kFloat32, 6);
    RunOptions options;
    options.loss.label_smoothing = 1.0f;
    options.loss.smoothing_semantics = SmoothingSemantics::kPyTorch;
    options.in_place = in_place;
    const auto want = oracle(problem, options);
    const RunResult result = run_ranks(problem, shards_from_sizes({20, 50}), options);
    for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6);
    EXPECT_LE(relative_error(result.grad, want.grad), 1e-6);
  }
  Problem problem = random_problem(3, 10, kFloat32, 6);
  RunOptions megatron;
  megatron.loss.label_smoothing = 1.0f;
  RunResult refused = run_ranks(problem, shards_from_sizes({10}), megatron);
  EXPECT_NE(refused.status[0].message().find("options.label_smoothing: expected a value in [0, 1), got 1"),
            std::string::npos)
      << refused.status[0].message();
  // A target logit of -inf: the uniform term is +inf, and so is the loss (no 0 x inf).
  Problem minus = random_problem(2, 10, kFloat32, 7);
  minus.set(0, minus.targets[0], -std::numeric_limits<float>::infinity());
  RunOptions one;
  one.loss.label_smoothing = 1.0f;
  one.loss.smoothing_semantics = SmoothingSemantics::kPyTorch;
  const RunResult infinite = run_ranks(minus, shards_from_sizes({4, 6}), one);
  ASSERT_TRUE(infinite.status[0].ok()) << infinite.status[0].message();
  EXPECT_EQ(infinite.per_rank[0].loss[0], std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(infinite.per_rank[0].loss[1]));
  RunOptions beyond;
  beyond.loss.label_smoothing = 1.5f;
  beyond.loss.smoothing_semantics = SmoothingSemantics::kPyTorch;
  refused = run_ranks(problem, shards_from_sizes({10}), beyond);
  EXPECT_NE(refused.status[0].message().find("expected a value in [0, 1] (PyTorch's semantics), got 1.5"),
            std::string::npos)
      << refused.status[0].message();
}

// Ties for the argmax go to the smallest column index, whichever rank holds it.
TEST(Options, ArgmaxTiesGoToTheSmallestIndexOnEveryRank) {
  for (int ranks : {1, 2, 4}) {
    Problem problem = random_problem(3, 40, kFloat32, 5, 0.5f);
    for (int64_t i = 0; i < 3; ++i) {
      problem.set(i, 5, 9.0f);   // rank 0 of 4
      problem.set(i, 35, 9.0f);  // rank 3 of 4
    }
    problem.targets = {5, 35, 12};
    RunOptions options;
    options.extras = true;
    const RunResult result = run_ranks(problem, shards_from_sizes(even_splits(40, ranks)), options);
    for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
    for (const RankOutputs& r : result.per_rank) EXPECT_EQ(r.target_is_argmax, (std::vector<float>{1, 0, 0}));
  }
}

// An ignore_index that is a real class ignores that class's tokens.
TEST(Options, IgnoreIndexInsideTheVocabulary) {
  Problem problem = random_problem(20, 30, kFloat32, 6);
  for (std::size_t i = 0; i < 20; i += 2) problem.targets[i] = 7;
  RunOptions options;
  options.loss.ignore_index = 7;
  options.loss.reduction = Reduction::kMean;
  expect_matches_oracle(problem, options, 3);
}

}  // namespace
}  // namespace vpce::test
