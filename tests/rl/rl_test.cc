// tests/rl/rl_test.cc: the RL outputs (vpce/rl.h) against the fp64 oracle
// (reference::policy) on R in-process ranks: log-probabilities, entropy and the gradient of
// non-uniform upstream gradients on both, for R 1-4 and uneven shards, every dtype in and out,
// in place, per-token and scalar temperatures, the transforms, padded vocabularies, ignored
// tokens, every SIMD target; the adversarial rows (1e4 offsets, -inf columns, near one-hot,
// NaN, every token ignored); one all-gather per forward and none in the backward; the same
// bits on every rank and thread count; and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "support.h"
#include "vpce/rl.h"

namespace vpce::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct PolicyConfig {
  rl::Options options;
  std::vector<float> temperatures;  // per token, or empty
  bool in_place = false;
  DataType grad_dtype = kFloat32;
  bool grad_log_prob = true;
  bool grad_entropy = true;
  bool sum_p_squared = true;  // ask for it (the gather's width 8) or not (6)
};

struct PolicyRankOutputs {
  std::vector<float> log_prob, entropy, sum_p_squared;
  std::vector<double> lse, mean_logit;
  int forward_gathers = 0, backward_gathers = 0;
};

struct PolicyRun {
  std::vector<Status> status;
  std::vector<PolicyRankOutputs> per_rank;
  std::vector<double> grad;  // [N, V]
};

// Non-uniform upstream gradients of both outputs, of both signs.
std::vector<float> upstream(int64_t n, float scale, int salt) {
  std::vector<float> g(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[i] = scale * (0.25f + static_cast<float>((i * 7 + salt) % 11) / 8.0f - 0.5f);
  return g;
}

PolicyRun run_policy(Problem& problem, const std::vector<VocabShard>& shards, const PolicyConfig& config,
                     int threads = 0) {
  const int ranks = static_cast<int>(shards.size());
  const int64_t n = problem.tokens;
  PolicyRun result;
  result.per_rank.resize(static_cast<std::size_t>(ranks));
  RunOptions layout;
  layout.in_place = config.in_place;
  layout.grad_dtype = config.grad_dtype;
  std::vector<std::byte> grad = grad_buffer(problem, layout);
  const std::vector<float> g_lp = upstream(n, 1.0f, 1), g_h = upstream(n, 0.6f, 4);
  std::unique_ptr<ThreadGroup> group;
  EXPECT_TRUE(ThreadGroup::create(ranks, &group, std::chrono::seconds(60)).ok());
  result.status = group->run([&](Communicator& inner) {
    CountingCommunicator comm(inner);
    const int r = comm.rank();
    const VocabShard& shard = shards[static_cast<std::size_t>(r)];
    PolicyRankOutputs& mine = result.per_rank[static_cast<std::size_t>(r)];
    mine.log_prob.assign(static_cast<std::size_t>(n), std::nanf(""));
    mine.entropy.assign(static_cast<std::size_t>(n), std::nanf(""));
    mine.sum_p_squared.assign(static_cast<std::size_t>(n), std::nanf(""));
    mine.lse.assign(static_cast<std::size_t>(n), std::nan(""));
    mine.mean_logit.assign(static_cast<std::size_t>(n), std::nan(""));
    rl::Options options = config.options;
    options.num_threads = threads;
    const TensorView x = problem.shard_view(shard);
    const TensorView y = TensorView::contiguous(problem.targets.data(), kInt64, {n});
    const TensorView t = TensorView::contiguous(const_cast<float*>(config.temperatures.data()), kFloat32, {n});
    const TensorView* temperatures = config.temperatures.empty() ? nullptr : &t;
    const TensorView log_prob = TensorView::contiguous(mine.log_prob.data(), kFloat32, {n});
    const TensorView entropy = TensorView::contiguous(mine.entropy.data(), kFloat32, {n});
    const TensorView lse = TensorView::contiguous(mine.lse.data(), kFloat64, {n});
    const TensorView mean = TensorView::contiguous(mine.mean_logit.data(), kFloat64, {n});
    const TensorView squares = TensorView::contiguous(mine.sum_p_squared.data(), kFloat32, {n});
    const rl::Outputs outputs{&log_prob, &entropy, &lse, &mean, config.sum_p_squared ? &squares : nullptr};
    if (Status s = rl::forward(comm, x, y, shard, options, outputs, temperatures); !s.ok()) {
      return s;
    }
    mine.forward_gathers = comm.calls;
    const TensorView glp = TensorView::contiguous(const_cast<float*>(g_lp.data()), kFloat32, {n});
    const TensorView gh = TensorView::contiguous(const_cast<float*>(g_h.data()), kFloat32, {n});
    const DataType grad_dtype = config.in_place ? problem.dtype : config.grad_dtype;
    const TensorView out = config.in_place
                               ? x
                               : TensorView::matrix(grad.data() + shard.vocab_begin * grad_dtype.bytes(), grad_dtype, n,
                                                    shard.vocab_end - shard.vocab_begin, problem.vocab);
    const rl::Upstream up{config.grad_log_prob ? &glp : nullptr, config.grad_entropy ? &gh : nullptr};
    const Status s = rl::backward(x, y, lse, &mean, up, shard, options, out, temperatures);
    mine.backward_gathers = comm.calls - mine.forward_gathers;
    return s;
  });
  result.grad = gathered_grad(problem, layout, grad);
  return result;
}

reference::PolicyResult policy_oracle(const Problem& problem, const PolicyConfig& config) {
  reference::Options o;
  o.ignore_index = config.options.ignore_index;
  o.logit_scale = config.options.logit_scale;
  o.softcap = config.options.softcap;
  o.valid_vocab = config.options.valid_vocab_size;
  std::vector<double> temperatures(config.temperatures.begin(), config.temperatures.end());
  if (temperatures.empty() && config.options.temperature != 1.0f) {
    temperatures.assign(static_cast<std::size_t>(problem.tokens), static_cast<double>(config.options.temperature));
  }
  const std::vector<float> g_lp = upstream(problem.tokens, 1.0f, 1), g_h = upstream(problem.tokens, 0.6f, 4);
  return reference::policy(problem.as_double(), problem.tokens, problem.vocab, problem.targets, temperatures,
                           config.grad_log_prob ? widen(g_lp) : std::vector<double>{},
                           config.grad_entropy ? widen(g_h) : std::vector<double>{}, o);
}

// Every output within 1e-6 of the oracle's (relative, or absolute below 1), on every rank
// bit for bit the same; the gradient within `grad_tolerance` of the largest element.
void expect_matches(const PolicyRun& run, const reference::PolicyResult& want, double grad_tolerance,
                    const std::string& label) {
  for (std::size_t r = 0; r < run.status.size(); ++r) {
    ASSERT_TRUE(run.status[r].ok()) << label << " rank " << r << ": " << run.status[r].message();
    EXPECT_EQ(run.per_rank[r].forward_gathers, 1) << label;
    EXPECT_EQ(run.per_rank[r].backward_gathers, 0) << label;
  }
  const PolicyRankOutputs& first = run.per_rank[0];
  for (std::size_t i = 0; i < want.log_prob.size(); ++i) {
    const double lp = want.log_prob[i], h = want.entropy[i];
    EXPECT_NEAR(first.log_prob[i], lp, 1e-6 * std::max(1.0, std::fabs(lp))) << label << " token " << i;
    EXPECT_NEAR(first.entropy[i], h, 1e-6 * std::max(1.0, std::fabs(h))) << label << " token " << i;
    if (!std::isnan(first.sum_p_squared[i])) {  // (asked for)
      const double sq = want.sum_p_squared[i];
      EXPECT_NEAR(first.sum_p_squared[i], sq, 1e-6 * sq) << label << " token " << i;
    }
    EXPECT_LE(first.log_prob[i], 0.0f) << label;
    EXPECT_GE(first.entropy[i], 0.0f) << label;
    for (std::size_t r = 1; r < run.per_rank.size(); ++r) {
      EXPECT_EQ(std::bit_cast<uint32_t>(run.per_rank[r].log_prob[i]), std::bit_cast<uint32_t>(first.log_prob[i]));
      EXPECT_EQ(std::bit_cast<uint32_t>(run.per_rank[r].entropy[i]), std::bit_cast<uint32_t>(first.entropy[i]));
    }
  }
  EXPECT_LE(relative_error(run.grad, want.grad), grad_tolerance) << label;
}

std::vector<float> mixed_temperatures(int64_t n) {
  const float choices[] = {0.5f, 1.0f, 1.7f};
  std::vector<float> t(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = choices[i % 3];
  return t;
}

// Ranks 1-4, even and uneven shards, per-token temperatures in {0.5, 1, 1.7}, both upstream
// gradients, fp32 logits: within 1e-6 (outputs) and 1e-5 (gradient) of the oracle.
TEST(RlOutputs, MatchTheOracleForEveryRankCountAndShardSplit) {
  const int64_t vocab = 1003;
  for (int ranks = 1; ranks <= 4; ++ranks) {
    for (bool uneven : {false, true}) {
      Problem p = random_problem(37, vocab, kFloat32, 100 + ranks);
      std::vector<int64_t> sizes = even_splits(vocab, ranks);
      if (uneven && ranks > 1) {
        sizes[0] += 200;
        sizes[static_cast<std::size_t>(ranks - 1)] -= 200;
      }
      const std::vector<VocabShard> shards = shards_from_sizes(sizes);
      // Targets on the shards' first and last columns.
      for (std::size_t s = 0; s < shards.size() && 2 * s + 1 < p.targets.size(); ++s) {
        p.targets[2 * s] = shards[s].vocab_begin;
        p.targets[2 * s + 1] = shards[s].vocab_end - 1;
      }
      PolicyConfig config;
      config.temperatures = mixed_temperatures(p.tokens);
      const reference::PolicyResult want = policy_oracle(p, config);
      expect_matches(run_policy(p, shards, config), want, 1e-5,
                     "R " + std::to_string(ranks) + (uneven ? " uneven" : " even"));
    }
  }
}

// A vocabulary that is a multiple of nothing (151,937, Qwen's), three ranks.
TEST(RlOutputs, MatchTheOracleOnALargePrimeLikeVocabulary) {
  Problem p = random_problem(5, 151937, kFloat32, 7);
  PolicyConfig config;
  config.temperatures = mixed_temperatures(p.tokens);
  const reference::PolicyResult want = policy_oracle(p, config);
  expect_matches(run_policy(p, shards_from_sizes(even_splits(151937, 3)), config), want, 1e-5, "V 151937");
}

// Every input dtype, every output dtype, in place; a scalar temperature; either upstream alone.
TEST(RlOutputs, MatchTheOracleForEveryDtypeAndUpstream) {
  const int64_t vocab = 517;
  const std::vector<VocabShard> shards = shards_from_sizes({300, 217});
  for (DataType in : {kFloat32, kBFloat16, kFloat16}) {
    for (int mode = 0; mode < 6; ++mode) {
      Problem p = random_problem(19, vocab, in, 11);
      PolicyConfig config;
      config.options.temperature = 0.7f;
      config.in_place = mode == 3;
      config.grad_dtype = mode == 1 ? kBFloat16 : mode == 2 ? kFloat16 : kFloat32;
      config.grad_log_prob = mode != 4;
      config.grad_entropy = mode != 5;
      config.sum_p_squared = mode % 2 == 0;
      const reference::PolicyResult want = policy_oracle(p, config);
      const DataType out = config.in_place ? in : config.grad_dtype;
      // The gradient's own rounding: 2^-9 of the largest element for bf16, 2^-12 for fp16.
      const double tolerance = out == kBFloat16 ? 4e-3 : out == kFloat16 ? 5e-4 : 1e-5;
      expect_matches(run_policy(p, shards, config), want, tolerance, to_string(in) + " mode " + std::to_string(mode));
    }
  }
}

// The transforms and the padding compose: logit scale, soft cap, a padded vocabulary whose
// padding would dominate if it leaked, ignored tokens (0 and a zero gradient).
TEST(RlOutputs, ComposeWithTheTransformsPaddingAndIgnoredTokens) {
  const int64_t vocab = 700;
  const std::vector<VocabShard> shards = shards_from_sizes({250, 250, 200});
  for (int variant = 0; variant < 3; ++variant) {
    Problem p = random_problem(23, vocab, kFloat32, 21 + variant);
    PolicyConfig config;
    config.temperatures = mixed_temperatures(p.tokens);
    config.options.valid_vocab_size = vocab - 60;  // the padding spans the last two shards
    for (int64_t& y : p.targets) y %= vocab - 60;
    for (int64_t i = 0; i < p.tokens; ++i) {
      for (int64_t v = vocab - 60; v < vocab; ++v) p.set(i, v, 40.0f);
    }
    for (std::size_t i = 2; i < p.targets.size(); i += 5) p.targets[i] = -100;
    if (variant == 1) config.options.logit_scale = 0.6f;
    if (variant == 2) {
      config.options.softcap = 5.0f;
      config.options.logit_scale = 1.3f;
    }
    const reference::PolicyResult want = policy_oracle(p, config);
    const PolicyRun run = run_policy(p, shards, config);
    expect_matches(run, want, 1e-5, "variant " + std::to_string(variant));
    for (std::size_t i = 2; i < p.targets.size(); i += 5) {
      EXPECT_EQ(run.per_rank[0].log_prob[i], 0.0f);
      EXPECT_EQ(run.per_rank[0].entropy[i], 0.0f);
      for (int64_t v = 0; v < vocab; ++v) EXPECT_EQ(run.grad[i * vocab + v], 0.0);
    }
    for (int64_t i = 0; i < p.tokens; ++i) {
      for (int64_t v = vocab - 60; v < vocab; ++v) EXPECT_EQ(run.grad[i * vocab + v], 0.0);
    }
  }
}

// The gradient on every SIMD target this CPU runs (the entropy's term is a SIMD path of its own).
TEST(RlOutputs, GradientMatchesTheOracleOnEverySimdTarget) {
  Problem base = random_problem(9, 2000, kFloat32, 5);
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    for (DataType in : {kFloat32, kBFloat16}) {
      Problem p = random_problem(9, 2000, in, 5);
      PolicyConfig config;
      config.temperatures = mixed_temperatures(p.tokens);
      config.in_place = in == kBFloat16;
      const reference::PolicyResult want = policy_oracle(p, config);
      expect_matches(run_policy(p, shards_from_sizes({1000, 1000}), config), want, in == kBFloat16 ? 4e-3 : 1e-5,
                     variant.name + " " + to_string(in));
    }
  }
  use_best_simd_variant();
}

// Logits of 1e4 +- a few (the exp's argument and E_p[z] far from 0), a column of -inf on every
// token, a near one-hot row (a gap of 60), all finite: within the bars, entropy >= 0.
TEST(RlOutputs, AdversarialRowsKeepTheirAccuracy) {
  const int64_t vocab = 400;
  Problem p = random_problem(6, vocab, kFloat32, 3, 2.0f);
  for (int64_t v = 0; v < vocab; ++v) {
    p.set(0, v, 1e4f + static_cast<float>(p.at(0, v)));
    p.set(1, v, -1e4f + static_cast<float>(p.at(1, v)));
    p.set(2, v, v == 17 ? 60.0f : 0.0f);  // near one-hot
    if (v % 50 == 3) p.set(3, v, -kInf);
  }
  p.targets[3] = 4;
  p.targets[2] = 17;
  PolicyConfig config;
  config.temperatures = {1.0f, 1.0f, 1.7f, 0.5f, 1.0f, 1.7f};
  const reference::PolicyResult want = policy_oracle(p, config);
  const PolicyRun run = run_policy(p, shards_from_sizes({150, 250}), config);
  expect_matches(run, want, 1e-5, "adversarial");
  EXPECT_GE(run.per_rank[0].entropy[2], 0.0f);
  for (double g : run.grad) EXPECT_TRUE(std::isfinite(g));
}

// The keep-mask (docs/rl.md): the rollout's support after top-k or top-p given as -inf on the
// logits it dropped. Per token, the support is the k = 1, 4 or 9 largest columns or the top-p
// prefix (p = 0.9) of the tempered distribution, found here in fp64; the sampled token is in
// it. Against the oracle of the masked logits and, directly, the renormalised softmax over
// the support: log p_y = z_y - log sum_{v in S} e^z_v; outside the support the gradient is
// exactly 0 (not NaN); a support of one column gives log p 0, entropy 0, gradient 0.
TEST(RlOutputs, AKeepMaskGivenAsMinusInfinityRenormalisesOverTheSupport) {
  const int64_t vocab = 301, n = 12;
  for (int ranks = 1; ranks <= 3; ++ranks) {
    Problem p = random_problem(n, vocab, kFloat32, 20 + ranks, 3.0f);
    PolicyConfig config;
    config.temperatures = mixed_temperatures(n);
    std::vector<std::vector<bool>> kept(static_cast<std::size_t>(n), std::vector<bool>(vocab, false));
    std::vector<double> support_lse(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const double t = config.temperatures[i];
      std::vector<int64_t> order(static_cast<std::size_t>(vocab));
      for (int64_t v = 0; v < vocab; ++v) order[v] = v;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p.at(i, a) > p.at(i, b); });
      int64_t size = i % 4 == 0 ? 1 : i % 4 == 1 ? 4 : i % 4 == 2 ? 9 : 0;
      if (size == 0) {  // top-p 0.9: the shortest prefix holding 90 % of the probability
        double total = 0.0, mass = 0.0;
        for (int64_t v = 0; v < vocab; ++v) total += std::exp((p.at(i, v) - p.at(i, order[0])) / t);
        while (mass < 0.9 * total) mass += std::exp((p.at(i, order[size++]) - p.at(i, order[0])) / t);
      }
      double sum = 0.0;
      for (int64_t k = 0; k < size; ++k) {
        kept[i][order[k]] = true;
        sum += std::exp((p.at(i, order[k]) - p.at(i, order[0])) / t);
      }
      support_lse[i] = p.at(i, order[0]) / t + std::log(sum);
      p.targets[i] = order[(i * 5) % size];  // a token the rollout could sample
      for (int64_t v = 0; v < vocab; ++v) {
        if (!kept[i][v]) p.set(i, v, -kInf);
      }
    }
    std::vector<int64_t> sizes = even_splits(vocab, ranks);
    if (ranks > 1) {
      sizes[0] += 31;
      sizes.back() -= 31;
    }
    const std::string label = "keep-mask, R " + std::to_string(ranks);
    const PolicyRun run = run_policy(p, shards_from_sizes(sizes), config);
    expect_matches(run, policy_oracle(p, config), 1e-5, label);
    for (int64_t i = 0; i < n; ++i) {
      const double direct = p.at(i, p.targets[i]) / config.temperatures[i] - support_lse[i];
      EXPECT_NEAR(run.per_rank[0].log_prob[i], direct, 1e-6 * std::max(1.0, std::fabs(direct))) << label;
      for (int64_t v = 0; v < vocab; ++v) {
        if (!kept[i][v] || i % 4 == 0) EXPECT_EQ(run.grad[i * vocab + v], 0.0) << label << " " << i << ", " << v;
      }
      if (i % 4 == 0) {
        EXPECT_EQ(run.per_rank[0].log_prob[i], 0.0f) << label;
        EXPECT_EQ(run.per_rank[0].entropy[i], 0.0f) << label;
      }
    }
  }
}

// Logits of 1e4 +- a few at a temperature other than 1: z = x / T rounds to fp32 as every
// framework's logits.div_(T) does, each z off by up to 2^-24 |z|, so the outputs are within a
// few of those roundings of the oracle's (here 6e-4 |z|-units: measured 2.5e-5), not 1e-6.
TEST(RlOutputs, LargeOffsetsAtATemperatureKeepFp32sRoundingOfZ) {
  const int64_t vocab = 400;
  Problem p = random_problem(2, vocab, kFloat32, 3, 2.0f);
  for (int64_t v = 0; v < vocab; ++v) {
    p.set(0, v, 1e4f + static_cast<float>(p.at(0, v)));
    p.set(1, v, -1e4f + static_cast<float>(p.at(1, v)));
  }
  PolicyConfig config;
  config.temperatures = {1.7f, 0.5f};
  const reference::PolicyResult want = policy_oracle(p, config);
  const PolicyRun run = run_policy(p, shards_from_sizes({150, 250}), config);
  ASSERT_TRUE(run.status[0].ok());
  for (std::size_t i = 0; i < 2; ++i) {
    const double z_rounding = 0x1p-24 * 1e4 / config.temperatures[i];
    EXPECT_NEAR(run.per_rank[0].log_prob[i], want.log_prob[i], 8 * z_rounding);
    EXPECT_NEAR(run.per_rank[0].entropy[i], want.entropy[i], 8 * z_rounding);
  }
  EXPECT_LE(relative_error(run.grad, want.grad), 1e-3);
}

// Every token ignored: 0, never NaN, and a zero gradient; a NaN logit makes its token's outputs
// NaN (and leaves the others finite).
TEST(RlOutputs, AllIgnoredGiveZerosAndNanGivesNan) {
  Problem p = random_problem(4, 300, kFloat32, 9);
  for (int64_t& y : p.targets) y = -100;
  PolicyConfig config;
  PolicyRun run = run_policy(p, shards_from_sizes({100, 200}), config);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(run.per_rank[1].log_prob[i], 0.0f);
    EXPECT_EQ(run.per_rank[1].entropy[i], 0.0f);
  }
  for (double g : run.grad) EXPECT_EQ(g, 0.0);

  Problem q = random_problem(3, 300, kFloat32, 9);
  q.set(1, 250, std::nanf(""));
  run = run_policy(q, shards_from_sizes({100, 200}), config);
  ASSERT_TRUE(run.status[0].ok());
  EXPECT_TRUE(std::isnan(run.per_rank[0].log_prob[1]));
  EXPECT_TRUE(std::isnan(run.per_rank[0].entropy[1]));
  EXPECT_TRUE(std::isnan(run.grad[1 * 300 + 5]));
  for (std::size_t i : {0u, 2u}) {
    EXPECT_TRUE(std::isfinite(run.per_rank[0].log_prob[i]));
    EXPECT_TRUE(std::isfinite(run.grad[i * 300 + 5]));
  }
}

// The same bits for 1 and 2 threads, and from run to run.
TEST(RlOutputs, BitIdenticalAcrossThreadCountsAndRuns) {
  PolicyConfig config;
  config.temperatures = mixed_temperatures(40);
  std::vector<PolicyRun> runs;
  for (int threads : {1, 2, 2}) {
    Problem p = random_problem(40, 40000, kBFloat16, 77);
    config.in_place = false;
    runs.push_back(run_policy(p, shards_from_sizes({20000, 20000}), config, threads));
  }
  for (std::size_t k = 1; k < runs.size(); ++k) {
    EXPECT_EQ(runs[k].per_rank[0].log_prob, runs[0].per_rank[0].log_prob);
    EXPECT_EQ(runs[k].per_rank[0].entropy, runs[0].per_rank[0].entropy);
    EXPECT_EQ(runs[k].grad, runs[0].grad);
  }
}

// Bad arguments: each named, nothing written; ranks that disagree all return the same error.
TEST(RlOutputs, BadArgumentsAreNamed) {
  Problem p = random_problem(4, 100, kFloat32, 1);
  Loopback comm;
  const VocabShard shard{0, 100, 100};
  const TensorView x = p.shard_view(shard);
  const TensorView y = TensorView::contiguous(p.targets.data(), kInt64, {4});
  std::vector<float> lp(4, 7.0f);
  std::vector<double> lse(4), mean(4);
  const TensorView log_prob = TensorView::contiguous(lp.data(), kFloat32, {4});
  const TensorView lse_view = TensorView::contiguous(lse.data(), kFloat64, {4});
  const TensorView mean_view = TensorView::contiguous(mean.data(), kFloat64, {4});
  auto forward_with = [&](rl::Options o, const TensorView* t) {
    return rl::forward(comm, x, y, shard, o, {&log_prob, nullptr, &lse_view, &mean_view}, t);
  };
  rl::Options o;
  o.temperature = 0.0f;
  Status s = forward_with(o, nullptr);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("options.temperature"), std::string::npos) << s.message();
  o.temperature = 2.0f;
  std::vector<float> t = {1.0f, 0.5f, -1.0f, 1.0f};
  const TensorView t_view = TensorView::contiguous(t.data(), kFloat32, {4});
  s = forward_with(o, &t_view);
  EXPECT_NE(s.message().find("1 (per-token temperatures are given)"), std::string::npos) << s.message();
  s = forward_with(rl::Options{}, &t_view);
  EXPECT_NE(s.message().find("temperatures: expected finite values > 0 and >= "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(", got -1 at token 2"), std::string::npos) << s.message();
  EXPECT_EQ(lp[0], 7.0f);  // nothing written
  std::vector<float> grad(400);
  const TensorView g = TensorView::matrix(grad.data(), kFloat32, 4, 100, 100);
  const TensorView glp = TensorView::contiguous(lp.data(), kFloat32, {4});
  s = rl::backward(x, y, lse_view, nullptr, {&glp, &glp}, shard, rl::Options{}, g);
  EXPECT_NE(s.message().find("mean_logit: expected the forward's mean_logit"), std::string::npos) << s.message();
  const TensorView lse_wrong = TensorView::contiguous(lp.data(), kInt32, {4});
  s = rl::backward(x, y, lse_wrong, &mean_view, {&glp, nullptr}, shard, rl::Options{}, g);
  EXPECT_NE(s.message().find("lse"), std::string::npos) << s.message();

  // Two ranks disagreeing on the temperature both fail, naming it.
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group, std::chrono::seconds(20)).ok());
  const std::vector<Status> statuses = group->run([&](Communicator& c) {
    const VocabShard half{c.rank() * 50, c.rank() * 50 + 50, 100};
    rl::Options mine;
    mine.temperature = c.rank() == 0 ? 1.0f : 0.9f;
    std::vector<float> out(4);
    std::vector<double> l(4);
    const TensorView o1 = TensorView::contiguous(out.data(), kFloat32, {4});
    const TensorView o2 = TensorView::contiguous(l.data(), kFloat64, {4});
    return rl::forward(c, p.shard_view(half), y, half, mine, {&o1, nullptr, &o2, nullptr});
  });
  for (const Status& st : statuses) {
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("options.temperature"), std::string::npos) << st.message();
  }

  // A number on rank 0, per-token temperatures on rank 1: named as that, not as rank 1's
  // options.temperature (1 where per-token temperatures are given).
  const std::vector<Status> mixed = group->run([&](Communicator& c) {
    const VocabShard half{c.rank() * 50, c.rank() * 50 + 50, 100};
    std::vector<float> per_token(4, 0.7f);
    const TensorView t = TensorView::contiguous(per_token.data(), kFloat32, {4});
    rl::Options mine;
    if (c.rank() == 0) mine.temperature = 0.7f;
    std::vector<float> out(4);
    std::vector<double> l(4);
    const TensorView o1 = TensorView::contiguous(out.data(), kFloat32, {4});
    const TensorView o2 = TensorView::contiguous(l.data(), kFloat64, {4});
    return rl::forward(c, p.shard_view(half), y, half, mine, {&o1, nullptr, &o2, nullptr},
                       c.rank() == 1 ? &t : nullptr);
  });
  for (const Status& st : mixed) {
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("ranks disagree on whether temperatures are given per token"), std::string::npos)
        << st.message();
  }

  // Per-token temperatures: a bad one on rank 1 only, then ranks given different values: every
  // rank fails alike, naming them.
  for (int variant = 0; variant < 2; ++variant) {
    const std::vector<Status> both = group->run([&](Communicator& c) {
      const VocabShard half{c.rank() * 50, c.rank() * 50 + 50, 100};
      std::vector<float> mine = {1.0f, 0.5f, 1.5f, 1.0f};
      if (c.rank() == 1) mine[2] = variant == 0 ? -1.0f : 1.25f;
      const TensorView t = TensorView::contiguous(mine.data(), kFloat32, {4});
      std::vector<float> out(4);
      std::vector<double> l(4);
      const TensorView o1 = TensorView::contiguous(out.data(), kFloat32, {4});
      const TensorView o2 = TensorView::contiguous(l.data(), kFloat64, {4});
      return rl::forward(c, p.shard_view(half), y, half, rl::Options{}, {&o1, nullptr, &o2, nullptr}, &t);
    });
    const char* want = variant == 0 ? "got -1 at token 2" : "ranks disagree on the targets, weights or temperatures";
    for (const Status& st : both) {
      EXPECT_FALSE(st.ok());
      EXPECT_NE(st.message().find(want), std::string::npos) << st.message();
    }
  }
}

// The smallest float T with b / T <= FLT_MAX, b = logit_scale (and softcap, when on): stepped
// to from b / FLT_MAX, so that it does not depend on how the library finds it.
float smallest_temperature(double b) {
  constexpr double kLargest = std::numeric_limits<float>::max();
  auto t = static_cast<float>(b / kLargest);
  while (b / static_cast<double>(t) > kLargest) t = std::nextafter(t, 1.0f);
  while (b / static_cast<double>(std::nextafter(t, 0.0f)) <= kLargest) t = std::nextafter(t, 0.0f);
  return t;
}

// The bound a refusal names: the number after ">= " in its message.
float named_bound(const Status& s) {
  const std::size_t at = s.message().find(">= ");
  return at == std::string::npos ? 0.0f : std::strtof(s.message().c_str() + at + 3, nullptr);
}

// A temperature so small that logit_scale / T (or softcap / T) overflows fp32 made every logit
// +-inf and the outputs NaN, with success: now refused, as a number or per token, naming the
// smallest usable one for the options (which scales with logit_scale and the soft-cap); that
// smallest one is taken, and on logits of its size matches the oracle.
TEST(RlOutputs, TemperaturesSoSmallThatTheTransformOverflowsAreRefused) {
  const float at_scale_1 = smallest_temperature(1.0);
  EXPECT_GT(at_scale_1, 2.9e-39f);
  EXPECT_LT(at_scale_1, 3.0e-39f);
  const int64_t n = 4, vocab = 60;
  Problem p = random_problem(n, vocab, kFloat32, 91);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t v = 0; v < vocab; ++v) p.set(i, v, static_cast<float>((i * 31 + v * 17) % 9 - 4) * 1.5e-38f);
  }
  PolicyConfig config;
  config.options.temperature = at_scale_1;  // z = x / T up to 20
  expect_matches(run_policy(p, shards_from_sizes({25, 35}), config), policy_oracle(p, config), 1e-5,
                 "the smallest temperature");
  config.options.temperature = 1.0f;
  config.temperatures = {1.0f, at_scale_1, 0.5f, at_scale_1};
  expect_matches(run_policy(p, shards_from_sizes({25, 35}), config), policy_oracle(p, config), 1e-5,
                 "the smallest temperature per token");

  Loopback comm;
  const VocabShard shard{0, vocab, vocab};
  const TensorView x = p.shard_view(shard);
  const TensorView y = TensorView::contiguous(p.targets.data(), kInt64, {n});
  std::vector<float> lp(n, 7.0f);
  std::vector<double> lse(n);
  const TensorView log_prob = TensorView::contiguous(lp.data(), kFloat32, {n});
  const TensorView lse_view = TensorView::contiguous(lse.data(), kFloat64, {n});
  const auto forward_with = [&](const rl::Options& o, const std::vector<float>& per_token) {
    const TensorView t = TensorView::contiguous(const_cast<float*>(per_token.data()), kFloat32, {n});
    return rl::forward(comm, x, y, shard, o, {&log_prob, nullptr, &lse_view, nullptr},
                       per_token.empty() ? nullptr : &t);
  };
  rl::Options o;
  o.temperature = std::nextafter(at_scale_1, 0.0f);
  Status s = forward_with(o, {});
  EXPECT_NE(s.message().find("options.temperature: expected a finite value > 0 and >= "), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("(logit_scale / T must be finite in fp32)"), std::string::npos) << s.message();
  EXPECT_EQ(named_bound(s), at_scale_1) << s.message();
  s = forward_with(rl::Options{}, {1.0f, 1e-40f, 1.0f, 1.0f});
  EXPECT_NE(s.message().find("temperatures: expected finite values > 0 and >= "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("got 1e-40 at token 1"), std::string::npos) << s.message();
  EXPECT_EQ(named_bound(s), at_scale_1) << s.message();
  // logit_scale 10: 1e-38 overflows (10 / 1e-38 = 1e39), as a number and per token.
  o.logit_scale = 10.0f;
  o.temperature = 1e-38f;
  s = forward_with(o, {});
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
  EXPECT_EQ(named_bound(s), smallest_temperature(10.0)) << s.message();
  o.temperature = 1.0f;
  s = forward_with(o, {1.0f, 1.0f, 1e-38f, 1.0f});
  EXPECT_NE(s.message().find("got 1e-38 at token 2"), std::string::npos) << s.message();
  // A soft-cap of 50: softcap / T overflows at 1e-37 (5e38) where logit_scale / T does not.
  o.logit_scale = 1.0f;
  o.softcap = 50.0f;
  o.temperature = 1e-37f;
  s = forward_with(o, {});
  EXPECT_NE(s.message().find("(logit_scale / T and softcap / T must be finite in fp32)"), std::string::npos)
      << s.message();
  EXPECT_EQ(named_bound(s), smallest_temperature(50.0)) << s.message();
  EXPECT_EQ(lp[0], 7.0f);  // nothing written by any refusal
  o.softcap = 30.0f;       // 3e38: taken
  EXPECT_TRUE(forward_with(o, {}).ok());
}

}  // namespace
}  // namespace vpce::test
