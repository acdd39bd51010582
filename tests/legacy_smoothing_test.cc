// tests/legacy_smoothing_test.cc: SmoothingSemantics::kMegatronLegacy (Megatron's
// vocab_parallel_cross_entropy with label smoothing, which smooths over each rank's own
// shard) against the fp64 oracle given that rank's shard as the smoothing's support: each
// rank's loss and its columns of the gradient, for R in {1, 2, 3, 4} with uneven shards, with
// the options it composes with; and its errors (a shard too small, the staged functions).
#include <gtest/gtest.h>

#include <cmath>

#include "support.h"

namespace vpce::test {
namespace {

constexpr int64_t kTokens = 29;
constexpr int64_t kVocab = 1003;

std::vector<int64_t> uneven_sizes(int ranks) {
  switch (ranks) {
    case 1: return {kVocab};
    case 2: return {700, 303};
    case 3: return {400, 2, 601};  // the smallest shard the legacy smoothing takes (K - 1 = 1)
    default: return {250, 3, 500, 250};
  }
}

struct Variant {
  const char* name;
  void (*apply)(RunOptions&, Problem&);
};

const Variant kVariants[] = {
    {"plain", [](RunOptions&, Problem&) {}},
    {"ignore_weights_mean",
     [](RunOptions& o, Problem& p) {
       for (std::size_t i = 2; i < p.targets.size(); i += 5) p.targets[i] = -100;
       o.weights.resize(p.targets.size());
       for (std::size_t i = 0; i < o.weights.size(); ++i) o.weights[i] = 0.25f * static_cast<float>(i % 6);
       o.loss.reduction = Reduction::kMean;
       o.grad_scalar = 1.7f;
     }},
    {"padded",  // the padding inside the last shard: K counts its real columns
     [](RunOptions& o, Problem& p) {
       o.loss.valid_vocab_size = kVocab - 9;
       for (int64_t& y : p.targets) y %= kVocab - 9;
       for (int64_t i = 0; i < p.tokens; ++i) {
         for (int64_t v = kVocab - 9; v < kVocab; ++v) p.set(i, v, 40.0f);  // would dominate if it leaked
       }
     }},
    {"transforms",
     [](RunOptions& o, Problem&) {
       o.loss.z_loss_weight = 0.01f;
       o.loss.logit_scale = 0.7f;
       o.loss.softcap = 5.0f;
     }},
    {"large_offsets",  // logits near 1e4: the shard's mean relative to its max
     [](RunOptions&, Problem& p) {
       for (int64_t i = 0; i < p.tokens; ++i) {
         for (int64_t v = 0; v < p.vocab; ++v) p.set(i, v, static_cast<float>(p.at(i, v)) + 1.0e4f);
       }
     }},
};

struct Case {
  int variant;
  int ranks;
  bool in_place_bf16;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return std::string(kVariants[info.param.variant].name) + "_R" + std::to_string(info.param.ranks) +
         (info.param.in_place_bf16 ? "_bf16_in_place" : "");
}

class LegacySmoothing : public testing::TestWithParam<Case> {};

TEST_P(LegacySmoothing, EachRankMatchesTheOracleOnItsShard) {
  const Case& c = GetParam();
  Problem problem = random_problem(kTokens, kVocab, c.in_place_bf16 ? kBFloat16 : kFloat32, 700 + c.variant);
  RunOptions options;
  options.loss.label_smoothing = 0.1f;
  options.loss.smoothing_semantics = SmoothingSemantics::kMegatronLegacy;
  options.loss.num_threads = 2;
  options.in_place = c.in_place_bf16;
  kVariants[c.variant].apply(options, problem);
  const std::vector<VocabShard> shards = shards_from_sizes(uneven_sizes(c.ranks));
  const Problem original = problem;  // the oracle reads the logits before an in-place gradient
  const RunResult result = run_ranks(problem, shards, options);
  for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();

  const double grad_tol = c.in_place_bf16 ? 8e-3 : 1e-6;  // bf16's rounding of the gradient
  std::vector<double> losses;
  for (int r = 0; r < c.ranks; ++r) {
    reference::Options o = reference_options(options.loss);
    o.smoothing_begin = shards[static_cast<std::size_t>(r)].vocab_begin;
    o.smoothing_end = shards[static_cast<std::size_t>(r)].vocab_end;
    const std::vector<double> grad_loss = options.loss.reduction == Reduction::kNone
                                              ? widen(original.grad_loss)
                                              : std::vector<double>{static_cast<double>(options.grad_scalar)};
    const reference::Result want = reference::cross_entropy(original.as_double(), original.tokens, original.vocab,
                                                            original.targets, widen(options.weights), grad_loss, o);
    const RankOutputs& got = result.per_rank[static_cast<std::size_t>(r)];
    EXPECT_LE(relative_error(widen(got.loss), want.loss), 1e-6) << "rank " << r;
    EXPECT_LE(relative_error(got.lse, want.lse), 1e-6) << "rank " << r;
    // This rank's columns of the gradient, against the oracle's (the other ranks' columns hold
    // their own ranks' gradients, of their own losses).
    std::vector<double> mine, wanted;
    for (int64_t i = 0; i < kTokens; ++i) {
      for (int64_t v = shards[static_cast<std::size_t>(r)].vocab_begin;
           v < shards[static_cast<std::size_t>(r)].vocab_end; ++v) {
        mine.push_back(result.grad[static_cast<std::size_t>(i * kVocab + v)]);
        wanted.push_back(want.grad[static_cast<std::size_t>(i * kVocab + v)]);
      }
    }
    EXPECT_LE(relative_error(mine, wanted), grad_tol) << "rank " << r;
    for (double g : mine) ASSERT_TRUE(std::isfinite(g));
    losses.push_back(static_cast<double>(got.loss[0]));
  }
  // The smoothing differs by rank, and so do the losses (as in Megatron), unless one rank.
  if (c.ranks > 1) EXPECT_NE(losses[0], losses[1]);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int v = 0; v < static_cast<int>(std::size(kVariants)); ++v) {
    for (int ranks : {1, 2, 3, 4}) out.push_back({v, ranks, false});
  }
  out.push_back({0, 3, true});
  out.push_back({1, 2, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, LegacySmoothing, testing::ValuesIn(cases()), case_name);

// A shard of one valid column cannot take a K / (K - 1): that rank names it; the others
// hear of it through the forward's exchange, without hanging.
TEST(LegacySmoothingErrors, ShardOfOneColumnFailsOnEveryRank) {
  Problem problem = random_problem(4, 12, kFloat32, 5);
  RunOptions options;
  options.loss.label_smoothing = 0.1f;
  options.loss.smoothing_semantics = SmoothingSemantics::kMegatronLegacy;
  const RunResult result = run_ranks(problem, shards_from_sizes({11, 1}), options);
  EXPECT_NE(result.status[1].message().find("shard's valid columns"), std::string::npos) << result.status[1].message();
  EXPECT_NE(result.status[1].message().find("got 1"), std::string::npos) << result.status[1].message();
  EXPECT_FALSE(result.status[0].ok());
  // Without smoothing the semantics change nothing, and a shard of one column is fine.
  options.loss.label_smoothing = 0.0f;
  const RunResult plain = run_ranks(problem, shards_from_sizes({11, 1}), options);
  for (const Status& s : plain.status) EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST(LegacySmoothingErrors, StagedFunctionsRefuseIt) {
  Problem problem = random_problem(3, 10, kFloat32, 6);
  RunOptions options;
  options.staged = true;
  options.loss.label_smoothing = 0.1f;
  options.loss.smoothing_semantics = SmoothingSemantics::kMegatronLegacy;
  const RunResult result = run_ranks(problem, shards_from_sizes({5, 5}), options);
  for (const Status& s : result.status) {
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("options.smoothing_semantics"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("kMegatronLegacy"), std::string::npos) << s.message();
  }
}

TEST(LegacySmoothingErrors, RanksDisagreeingOnTheSemanticsFail) {
  Problem problem = random_problem(3, 10, kFloat32, 7);
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group).ok());
  const std::vector<VocabShard> shards = shards_from_sizes({5, 5});
  std::vector<float> loss(6);
  std::vector<double> lse(6);
  std::vector<int64_t> targets = problem.targets;
  const std::vector<Status> status = group->run([&](Communicator& comm) -> Status {
    const int r = comm.rank();
    LossOptions options;
    options.label_smoothing = 0.1f;
    options.smoothing_semantics = r == 0 ? SmoothingSemantics::kMegatron : SmoothingSemantics::kMegatronLegacy;
    const TensorView t = TensorView::contiguous(targets.data(), kInt64, {3});
    return forward(comm, problem.shard_view(shards[static_cast<std::size_t>(r)]), t,
                   shards[static_cast<std::size_t>(r)], options,
                   TensorView::contiguous(loss.data() + 3 * r, kFloat32, {3}),
                   TensorView::contiguous(lse.data() + 3 * r, kFloat64, {3}));
  });
  for (const Status& s : status) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("smoothing_semantics"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace vpce::test
