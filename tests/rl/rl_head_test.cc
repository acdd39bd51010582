// tests/rl/rl_head_test.cc: the RL outputs in the fused head (vpce::rl::linear_forward and
// linear_backward) against the fp64 oracle: the logits h W^T + b in fp64 from the stored
// operands, then reference::policy, then dh = dx W, dW = dx^T h, db = column sums of dx; for
// R 1-4 with uneven ranges, per-token temperatures, non-uniform upstream gradients on both
// outputs, fp32 and bf16 operands, small tiles, gradients written over and added into,
// ignored tokens (every 7th); one all-gather per forward; the same outputs on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "head_support.h"
#include "vpce/rl.h"

namespace vpce::test {
namespace {

struct Gathered {
  std::vector<Status> status;
  std::vector<std::vector<float>> log_prob, entropy;  // per rank
  std::vector<double> grad_hidden, grad_weight, grad_bias;
  std::vector<int> gathers;
};

std::vector<float> upstream_of(int64_t n, float scale, int salt) {
  std::vector<float> g(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[i] = scale * (static_cast<float>((i * 5 + salt) % 9) / 6.0f - 0.4f);
  return g;
}

// Recompute mode (linear_forward, then linear_backward), or with `chunked`
// linear_forward_backward given the upstream gradients up front.
Gathered run_policy_head(HeadProblem& p, const std::vector<int64_t>& sizes, const rl::Options& options,
                         const HeadOptions& head, const std::vector<float>& temperatures, bool accumulate,
                         bool chunked = false) {
  const int ranks = static_cast<int>(sizes.size());
  const int64_t n = p.tokens, h = p.hidden;
  const std::vector<VocabShard> shards = shards_from_sizes(sizes);
  Gathered out;
  out.log_prob.assign(static_cast<std::size_t>(ranks), std::vector<float>(static_cast<std::size_t>(n)));
  out.entropy = out.log_prob;
  out.gathers.assign(static_cast<std::size_t>(ranks), 0);
  std::vector<std::vector<float>> hidden_parts(static_cast<std::size_t>(ranks),
                                               std::vector<float>(static_cast<std::size_t>(n * h), 0.25f));
  std::vector<float> grad_weight(static_cast<std::size_t>(p.vocab * h), 0.25f), grad_bias(p.vocab, 0.25f);
  const std::vector<float> g_lp = upstream_of(n, 1.0f, 1), g_h = upstream_of(n, 0.5f, 3);
  std::unique_ptr<ThreadGroup> group;
  EXPECT_TRUE(ThreadGroup::create(ranks, &group, std::chrono::seconds(60)).ok());
  out.status = group->run([&](Communicator& inner) {
    CountingCommunicator comm(inner);
    const int r = comm.rank();
    const VocabShard& shard = shards[static_cast<std::size_t>(r)];
    const TensorView weight = p.weight_view(shard.vocab_begin, shard.vocab_end);
    const TensorView bias = p.bias_view(shard.vocab_begin, shard.vocab_end);
    const HeadInputs inputs{p.hidden_view(), weight, p.with_bias ? &bias : nullptr};
    const TensorView y = TensorView::contiguous(p.targets.data(), kInt64, {n});
    const TensorView t = TensorView::contiguous(const_cast<float*>(temperatures.data()), kFloat32, {n});
    const TensorView* tv = temperatures.empty() ? nullptr : &t;
    std::vector<double> lse(static_cast<std::size_t>(n)), mean(static_cast<std::size_t>(n));
    const TensorView lp = TensorView::contiguous(out.log_prob[r].data(), kFloat32, {n});
    const TensorView en = TensorView::contiguous(out.entropy[r].data(), kFloat32, {n});
    const TensorView lse_view = TensorView::contiguous(lse.data(), kFloat64, {n});
    const TensorView mean_view = TensorView::contiguous(mean.data(), kFloat64, {n});
    const TensorView glp = TensorView::contiguous(const_cast<float*>(g_lp.data()), kFloat32, {n});
    const TensorView gh = TensorView::contiguous(const_cast<float*>(g_h.data()), kFloat32, {n});
    const int64_t rows = shard.vocab_end - shard.vocab_begin;
    const TensorView dh = TensorView::matrix(hidden_parts[r].data(), kFloat32, n, h, h);
    const TensorView dw = TensorView::matrix(grad_weight.data() + shard.vocab_begin * h, kFloat32, rows, h, h);
    const TensorView db = TensorView::contiguous(grad_bias.data() + shard.vocab_begin, kFloat32, {rows});
    HeadGradients grads{{&dh, accumulate}, {&dw, accumulate}, {p.with_bias ? &db : nullptr, accumulate}};
    if (chunked) {
      int64_t collectives = 0;
      const Status s = rl::linear_forward_backward(comm, inputs, y, shard, options, head, {&glp, &gh},
                                                   {&lp, &en, &lse_view, &mean_view}, grads, tv, nullptr, &collectives);
      out.gathers[r] = comm.calls;
      EXPECT_EQ(collectives, comm.calls);
      return s;
    }
    if (Status s = rl::linear_forward(comm, inputs, y, shard, options, head, {&lp, &en, &lse_view, &mean_view}, tv);
        !s.ok()) {
      return s;
    }
    out.gathers[r] = comm.calls;
    return rl::linear_backward(inputs, y, lse_view, &mean_view, {&glp, &gh}, shard, options, head, grads, tv);
  });
  const double prefill = accumulate ? 0.25 : 0.0;
  out.grad_hidden.assign(static_cast<std::size_t>(n * h), 0.0);
  for (const auto& part : hidden_parts) {
    for (std::size_t k = 0; k < part.size(); ++k) out.grad_hidden[k] += static_cast<double>(part[k]) - prefill;
  }
  for (float w : grad_weight) out.grad_weight.push_back(static_cast<double>(w) - prefill);
  for (float b : grad_bias) out.grad_bias.push_back(static_cast<double>(b) - prefill);
  return out;
}

struct PolicyHeadOracle {
  reference::PolicyResult outputs;
  std::vector<double> grad_hidden, grad_weight, grad_bias;
};

PolicyHeadOracle policy_head_oracle(const HeadProblem& p, const rl::Options& options,
                                    const std::vector<float>& temperatures) {
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  std::vector<double> logits(static_cast<std::size_t>(n * v));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < v; ++c) {
      double sum = p.with_bias ? p.bias_at(c) : 0.0;
      for (int64_t k = 0; k < h; ++k) sum += p.hidden_at(i, k) * p.weight_at(c, k);
      logits[i * v + c] = sum;
    }
  }
  reference::Options o;
  o.ignore_index = options.ignore_index;
  o.valid_vocab = options.valid_vocab_size;
  o.logit_scale = options.logit_scale;
  o.softcap = options.softcap;
  const std::vector<float> g_lp = upstream_of(n, 1.0f, 1), g_h = upstream_of(n, 0.5f, 3);
  PolicyHeadOracle out;
  out.outputs = reference::policy(logits, n, v, p.targets, widen(temperatures), widen(g_lp), widen(g_h), o);
  const std::vector<double>& dx = out.outputs.grad;
  out.grad_hidden.assign(static_cast<std::size_t>(n * h), 0.0);
  out.grad_weight.assign(static_cast<std::size_t>(v * h), 0.0);
  out.grad_bias.assign(static_cast<std::size_t>(v), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < v; ++c) {
      const double d = dx[i * v + c];
      out.grad_bias[c] += d;
      for (int64_t k = 0; k < h; ++k) {
        out.grad_hidden[i * h + k] += d * p.weight_at(c, k);
        out.grad_weight[c * h + k] += d * p.hidden_at(i, k);
      }
    }
  }
  return out;
}

void expect_policy_matches(const Gathered& got, const PolicyHeadOracle& want, double grad_tolerance,
                           const std::string& label, int gathers = 1) {
  for (std::size_t r = 0; r < got.status.size(); ++r) {
    ASSERT_TRUE(got.status[r].ok()) << label << " rank " << r << ": " << got.status[r].message();
    EXPECT_EQ(got.gathers[r], gathers) << label;
    EXPECT_EQ(got.log_prob[r], got.log_prob[0]) << label;
    EXPECT_EQ(got.entropy[r], got.entropy[0]) << label;
  }
  // Relative to the largest value, as the head's loss is measured: the tiles' logits are fp32
  // GEMM sums, each within fp32's rounding of its H products (a token's own value can be
  // 1e-6 of itself off where the logits' roundings reach it at T = 0.5).
  EXPECT_LE(relative_error(widen(got.log_prob[0]), want.outputs.log_prob), 1e-6) << label;
  EXPECT_LE(relative_error(widen(got.entropy[0]), want.outputs.entropy), 1e-6) << label;
  EXPECT_LE(relative_error(got.grad_hidden, want.grad_hidden), grad_tolerance) << label;
  EXPECT_LE(relative_error(got.grad_weight, want.grad_weight), grad_tolerance) << label;
  EXPECT_LE(relative_error(got.grad_bias, want.grad_bias), grad_tolerance) << label;
}

std::vector<float> mixed_temperatures(int64_t n) {
  std::vector<float> t(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = i % 3 == 0 ? 0.5f : i % 3 == 1 ? 1.0f : 1.7f;
  return t;
}

TEST(RlHead, MatchesTheOracleForEveryRankCountWithUnevenRanges) {
  const int64_t vocab = 311;  // a prime: no shard split is even
  for (int ranks = 1; ranks <= 4; ++ranks) {
    HeadProblem p = random_head_problem(29, 24, vocab, kFloat32, 50 + ranks);
    std::vector<int64_t> sizes = even_splits(vocab, ranks);
    if (ranks > 1) {
      sizes[0] += 40;
      sizes.back() -= 40;
    }
    HeadOptions head;
    head.token_block = 8;  // several tiles each way
    head.vocab_block = 32;
    rl::Options options;
    const std::vector<float> temperatures = mixed_temperatures(p.tokens);
    const PolicyHeadOracle want = policy_head_oracle(p, options, temperatures);
    expect_policy_matches(run_policy_head(p, sizes, options, head, temperatures, ranks % 2 == 0), want, 1e-5,
                          "R " + std::to_string(ranks));
  }
}

TEST(RlHead, Bf16OperandsAndAScalarTemperatureMatchTheOracle) {
  HeadProblem p = random_head_problem(21, 32, 250, kBFloat16, 9);
  rl::Options options;
  options.temperature = 0.8f;
  const PolicyHeadOracle want =
      policy_head_oracle(p, options, std::vector<float>(static_cast<std::size_t>(p.tokens), 0.8f));
  // The oracle's products of the stored bf16 values in fp64: fp32 tiles are within 1e-6; the
  // gradients are written in fp32.
  expect_policy_matches(run_policy_head(p, {130, 120}, options, HeadOptions{}, {}, false), want, 1e-5, "bf16");
}

// The chunked mode: chunks of 8 of 29 tokens (4 gathers, the last one short), uneven ranges,
// per-token temperatures, gradients written over and added into; its outputs are the
// recompute mode's bit for bit.
TEST(RlHead, ChunkedModeMatchesTheOracleAndTheRecomputeModesOutputs) {
  const int64_t vocab = 311;  // a prime: no shard split is even
  for (int ranks = 1; ranks <= 4; ++ranks) {
    HeadProblem p = random_head_problem(29, 24, vocab, ranks == 3 ? kBFloat16 : kFloat32, 70 + ranks);
    std::vector<int64_t> sizes = even_splits(vocab, ranks);
    if (ranks > 1) {
      sizes[0] -= 30;
      sizes.back() += 30;
    }
    HeadOptions head;
    head.token_block = 4;
    head.vocab_block = 32;
    head.chunk_tokens = 8;
    rl::Options options;
    options.logit_scale = 0.9f;
    const std::vector<float> temperatures = mixed_temperatures(p.tokens);
    const PolicyHeadOracle want = policy_head_oracle(p, options, temperatures);
    const std::string label = "chunked, R " + std::to_string(ranks);
    const Gathered chunked = run_policy_head(p, sizes, options, head, temperatures, ranks % 2 == 1, true);
    expect_policy_matches(chunked, want, 1e-5, label, 4);
    const Gathered recompute = run_policy_head(p, sizes, options, head, temperatures, false);
    EXPECT_EQ(chunked.log_prob[0], recompute.log_prob[0]) << label;
    EXPECT_EQ(chunked.entropy[0], recompute.entropy[0]) << label;
  }
}

// The chunked mode is bit-identical run to run and for 1 and 2 threads (outputs and every
// gradient), as the recompute mode is.
TEST(RlHead, ChunkedModeIsBitIdenticalAcrossThreadCountsAndRuns) {
  HeadProblem p = random_head_problem(40, 16, 230, kFloat32, 17);
  HeadOptions head;
  head.token_block = 8;
  head.vocab_block = 32;
  head.chunk_tokens = 16;
  const std::vector<float> temperatures = mixed_temperatures(p.tokens);
  std::vector<Gathered> runs;
  for (int threads : {1, 2, 2}) {
    rl::Options options;
    options.num_threads = threads;
    runs.push_back(run_policy_head(p, {120, 110}, options, head, temperatures, false, true));
  }
  for (std::size_t k = 1; k < runs.size(); ++k) {
    EXPECT_EQ(runs[k].log_prob[0], runs[0].log_prob[0]);
    EXPECT_EQ(runs[k].entropy[0], runs[0].entropy[0]);
    EXPECT_EQ(runs[k].grad_hidden, runs[0].grad_hidden);
    EXPECT_EQ(runs[k].grad_weight, runs[0].grad_weight);
    EXPECT_EQ(runs[k].grad_bias, runs[0].grad_bias);
  }
}

// Ranks given different upstream gradients (or one given grad_entropy and the other not)
// all fail at the first gather, naming them, with nothing written; a rank whose
// grad_log_prob has the wrong length names it, and the other is told it failed, after the
// one gather both made.
TEST(RlHead, ChunkedRanksThatDisagreeOnTheUpstreamGradientsAllFail) {
  HeadProblem p = random_head_problem(6, 8, 40, kFloat32, 5);
  for (int variant = 0; variant < 3; ++variant) {
    std::unique_ptr<ThreadGroup> group;
    ASSERT_TRUE(ThreadGroup::create(2, &group, std::chrono::seconds(60)).ok());
    std::vector<std::vector<float>> grad_hidden(2, std::vector<float>(48, 7.0f));
    const std::vector<Status> status = group->run([&](Communicator& comm) {
      const int r = comm.rank();
      const VocabShard shard{r * 20, r * 20 + 20, 40};
      const HeadInputs inputs{p.hidden_view(), p.weight_view(shard.vocab_begin, shard.vocab_end), nullptr};
      const TensorView y = TensorView::contiguous(p.targets.data(), kInt64, {6});
      std::vector<float> g(6, 0.5f);
      if (r == 1 && variant == 0) g[3] = 0.25f;
      const TensorView gv = TensorView::contiguous(g.data(), kFloat32, {r == 1 && variant == 2 ? 5 : 6});
      const rl::Upstream upstream{&gv, r == 1 && variant == 1 ? &gv : nullptr};
      std::vector<float> lp(6);
      const TensorView lp_view = TensorView::contiguous(lp.data(), kFloat32, {6});
      const TensorView dh = TensorView::matrix(grad_hidden[r].data(), kFloat32, 6, 8, 8);
      int64_t collectives = -1;
      const Status s = rl::linear_forward_backward(comm, inputs, y, shard, rl::Options{}, HeadOptions{}, upstream,
                                                   {&lp_view, nullptr, nullptr, nullptr}, {{&dh, false}, {}, {}},
                                                   nullptr, nullptr, &collectives);
      EXPECT_EQ(collectives, 1);
      return s;
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(grad_hidden[r], std::vector<float>(48, 7.0f));
      if (variant == 2) continue;
      EXPECT_EQ(status[r].code(), Code::kInvalidUsage) << status[r].message();
      EXPECT_NE(status[r].message().find("upstream gradients"), std::string::npos) << status[r].message();
    }
    if (variant == 2) {
      EXPECT_EQ(status[1].code(), Code::kInvalidArgument) << status[1].message();
      EXPECT_NE(status[1].message().find("grad_log_prob"), std::string::npos) << status[1].message();
      EXPECT_EQ(status[0].code(), Code::kRemoteError) << status[0].message();
      EXPECT_NE(status[0].message().find("grad_log_prob"), std::string::npos) << status[0].message();
    }
  }
}

TEST(RlHead, DeviceAndBadArgumentsAreRefusedByName) {
  HeadProblem p = random_head_problem(4, 8, 20, kFloat32, 2);
  Loopback comm;
  const HeadInputs inputs{p.hidden_view(), p.weight_view(0, 20), nullptr};
  const TensorView y = TensorView::contiguous(p.targets.data(), kInt64, {4});
  std::vector<float> lp(4, 3.0f);
  const TensorView lp_view = TensorView::contiguous(lp.data(), kFloat32, {4});
  rl::Options options;
  options.temperature = -1.0f;
  Status s =
      rl::linear_forward(comm, inputs, y, {0, 20, 20}, options, HeadOptions{}, {&lp_view, nullptr, nullptr, nullptr});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("options.temperature"), std::string::npos) << s.message();
  // So small that the logit scale 2 / T overflows fp32: refused, naming the bound, in both modes.
  options.temperature = 5e-39f;
  options.logit_scale = 2.0f;
  s = rl::linear_forward(comm, inputs, y, {0, 20, 20}, options, HeadOptions{}, {&lp_view, nullptr, nullptr, nullptr});
  EXPECT_NE(s.message().find("options.temperature: expected a finite value > 0 and >= 5.877473e-39"), std::string::npos)
      << s.message();
  std::vector<float> per_token = {1.0f, 1.0f, 1.0f, 5e-39f};
  const TensorView t = TensorView::contiguous(per_token.data(), kFloat32, {4});
  std::vector<float> grad_log_prob(4, 1.0f);
  const TensorView up = TensorView::contiguous(grad_log_prob.data(), kFloat32, {4});
  options.temperature = 1.0f;
  s = rl::linear_forward_backward(comm, inputs, y, {0, 20, 20}, options, HeadOptions{}, {&up, nullptr},
                                  {&lp_view, nullptr, nullptr, nullptr}, {}, &t);
  EXPECT_NE(s.message().find("got 5e-39 at token 3"), std::string::npos) << s.message();
  EXPECT_EQ(lp[0], 3.0f);
}

}  // namespace
}  // namespace vpce::test
