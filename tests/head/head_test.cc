// tests/head/head_test.cc: the fused head (vpce/head.h) against the fp64 oracle of the
// product and the loss, on R in-process ranks with uneven vocabulary ranges, every loss
// option, both modes, both ways of writing the gradients; determinism across thread counts
// and runs; the collectives counted; bad arguments and disagreeing ranks refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"
#include "head/gemm.h"
#include "head_support.h"
#include "support.h"

namespace vpce::test {
namespace {

// HeadOptions::bf16_logit_gradients: the loss and lse as expect_matches; each gradient element
// within the bound of dx's bf16 rounding, 2^-8 sum |dx w| (plus fp32's 1e-5 of the largest),
// of the exact oracle; and the gradients far nearer the oracle whose dx is rounded to bf16
// than the exact one is (in the 2-norm, a quarter of that distance at most; the rest is
// where vpce's fp32 dx and the oracle's fall on either side of a rounding boundary), so that
// the check tells a rounded dx from an fp32 one.
void expect_within_bf16_logit_rounding(const HeadProblem& p, const HeadRun& run, const HeadResult& r) {
  expect_ok(r);
  const HeadOracle exact = head_oracle(p, run.loss, run.grad_scalar);
  const HeadOracle rounded = head_oracle(p, run.loss, run.grad_scalar, /*bf16_logit_gradients=*/true);
  EXPECT_LE(relative_error(widen(r.loss), exact.loss.loss), 1e-6);
  EXPECT_LE(relative_error(widen(r.lse), exact.loss.lse), 1e-6);
  auto check = [](const char* name, const std::vector<double>& got, const std::vector<double>& want,
                  const std::vector<double>& bound, const std::vector<double>& want_rounded) {
    SCOPED_TRACE(name);
    double largest = 0.0;
    for (double x : want) largest = std::max(largest, std::fabs(x));
    double from_rounded = 0.0, exact_from_rounded = 0.0;  // squared 2-norms
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_LE(std::fabs(got[i] - want[i]), 0x1p-8 * 1.01 * bound[i] + 1e-5 * largest) << "element " << i;
      from_rounded += (got[i] - want_rounded[i]) * (got[i] - want_rounded[i]);
      exact_from_rounded += (want[i] - want_rounded[i]) * (want[i] - want_rounded[i]);
    }
    EXPECT_GT(exact_from_rounded, 0.0);
    EXPECT_LE(std::sqrt(from_rounded), 0.25 * std::sqrt(exact_from_rounded));
  };
  check("grad_hidden", r.grad_hidden, exact.grad_hidden, exact.grad_hidden_bound, rounded.grad_hidden);
  check("grad_weight", r.grad_weight, exact.grad_weight, exact.grad_weight_bound, rounded.grad_weight);
  if (p.with_bias && run.want_bias) {
    check("grad_bias", r.grad_bias, exact.grad_bias, exact.grad_bias_bound, rounded.grad_bias);
  }
}

std::vector<LossOptions> every_option() {
  std::vector<LossOptions> all;
  LossOptions o;
  all.push_back(o);
  o.label_smoothing = 0.1f;
  all.push_back(o);
  o.smoothing_semantics = SmoothingSemantics::kPyTorch;
  all.push_back(o);
  o = {};
  o.z_loss_weight = 1e-3f;
  o.logit_scale = 0.7f;
  all.push_back(o);
  o = {};
  o.softcap = 5.0f;
  o.label_smoothing = 0.05f;
  all.push_back(o);
  o = {};
  o.reduction = Reduction::kSum;
  all.push_back(o);
  o.reduction = Reduction::kMean;
  o.label_smoothing = 0.2f;
  all.push_back(o);
  return all;
}

// Runs `body` once for each way this CPU runs the GEMMs of bf16 operands: with its bf16 dot
// products (gemm_bf16, the default where it has AVX512-BF16) and widened to fp32 (as every
// other CPU does).
void for_each_bf16_gemm(const std::function<void()>& body) {
  std::vector<bool> choices{false};
  if (detail::bf16_gemm_native()) choices.insert(choices.begin(), true);
  for (bool native : choices) {
    detail::set_bf16_instructions_allowed(native);
    SCOPED_TRACE(native ? "bf16 tiles from bf16 dot products" : "bf16 tiles widened to fp32");
    body();
  }
  detail::set_bf16_instructions_allowed(true);
}

class HeadModes : public ::testing::TestWithParam<Mode> {};

// Every option of every_option() on R = 1, 2 and 4 (uneven, one range empty), against the
// oracle; `check` runs one case (bf16: under each GEMM of for_each_bf16_gemm).
void every_option_and_rank_count(Mode mode, DataType dtype, int64_t hidden, uint64_t seed,
                                 const std::function<void(HeadProblem&, const HeadRun&)>& check) {
  for (int ranks : {1, 2, 4}) {
    for (LossOptions loss : every_option()) {
      if (mode == Mode::kChunked && loss.reduction == Reduction::kNone) loss.reduction = Reduction::kMean;
      HeadProblem p = random_head_problem(37, hidden, 203, dtype, seed++);
      HeadRun run;
      run.mode = mode;
      run.loss = loss;
      run.ranks = ranks;
      run.head.token_block = 8;
      run.head.vocab_block = 16;
      run.head.chunk_tokens = 16;
      run.grad_scalar = 1.5f;
      if (ranks == 4) run.sizes = {1, 100, 0, 102};  // uneven, one empty
      SCOPED_TRACE("ranks " + std::to_string(ranks) + " smoothing " + std::to_string(loss.label_smoothing));
      check(p, run);
    }
  }
}

TEST_P(HeadModes, MatchesTheOracleForEveryOptionAndRankCount) {
  every_option_and_rank_count(GetParam(), kFloat32, 24, 1,
                              [](HeadProblem& p, const HeadRun& run) { expect_matches(p, run, run_head(p, run)); });
}

// bf16 operands, fp32 gradients: the oracle reads the same stored values, so only fp32's
// rounding separates them, whichever GEMM makes the tiles.
TEST_P(HeadModes, Bf16OperandsMatchTheOracleForEveryOptionAndRankCountOnEitherGemm) {
  every_option_and_rank_count(GetParam(), kBFloat16, 40, 101, [](HeadProblem& p, const HeadRun& run) {
    for_each_bf16_gemm([&] { expect_matches(p, run, run_head(p, run)); });
  });
}

// bf16_logit_gradients: the same sweep, the gradients within dx's bf16 rounding.
TEST_P(HeadModes, Bf16LogitGradientsWithinTheirRoundingForEveryOptionAndRankCountOnEitherGemm) {
  every_option_and_rank_count(GetParam(), kBFloat16, 40, 201, [](HeadProblem& p, HeadRun run) {
    run.head.bf16_logit_gradients = true;
    for_each_bf16_gemm([&] { expect_within_bf16_logit_rounding(p, run, run_head(p, run)); });
  });
}

TEST_P(HeadModes, PaddedVocabularyWeightsAndExtrasMatchTheOracle) {
  HeadProblem p = random_head_problem(29, 16, 150, kFloat32, 77);
  for (int64_t i = 0; i < p.tokens; ++i) {
    p.weights.push_back(static_cast<float>(i % 4) * 0.5f);
    if (p.targets[static_cast<std::size_t>(i)] >= 120) p.targets[static_cast<std::size_t>(i)] = 119;
  }
  HeadRun run;
  run.mode = GetParam();
  run.loss.valid_vocab_size = 120;  // rows [120, 150) are padding: zero gradient
  run.loss.reduction = Reduction::kMean;
  run.ranks = 2;
  run.sizes = {64, 86};
  run.head.token_block = 4;
  run.head.vocab_block = 32;
  run.head.chunk_tokens = 8;
  const HeadResult r = run_head(p, run);
  expect_matches(p, run, r);
  for (int64_t v = 120; v < 150; ++v) {
    for (int64_t k = 0; k < p.hidden; ++k) EXPECT_EQ(r.grad_weight[static_cast<std::size_t>(v * p.hidden + k)], 0.0);
    EXPECT_EQ(r.grad_bias[static_cast<std::size_t>(v)], 0.0);
  }
}

TEST_P(HeadModes, AWorkspaceKeptAcrossCallsOfOtherShapesChangesNothing) {
  // The workspace's buffers are reused without being cleared: a first problem with logits of
  // a few times 1e4 leaves its values in them (larger than the second's buffers need), and
  // the second (padding columns, ignored tokens, weights) must not read any of it.
  std::vector<Workspace> workspaces(2);
  HeadProblem big = random_head_problem(64, 24, 400, kFloat32, 91, 1e4f);
  HeadRun first;
  first.mode = GetParam();
  first.loss.reduction = Reduction::kSum;
  first.ranks = 2;
  first.head.token_block = 8;
  first.head.vocab_block = 64;
  first.head.chunk_tokens = 64;
  first.workspaces = &workspaces;
  expect_ok(run_head(big, first));
  HeadProblem p = random_head_problem(29, 16, 150, kFloat32, 78);
  for (int64_t i = 0; i < p.tokens; ++i) {
    p.weights.push_back(static_cast<float>(i % 3) * 0.5f);
    if (p.targets[static_cast<std::size_t>(i)] >= 120) p.targets[static_cast<std::size_t>(i)] = 119;
  }
  HeadRun run;
  run.mode = GetParam();
  run.loss.valid_vocab_size = 120;
  run.loss.reduction = Reduction::kMean;
  run.ranks = 2;
  run.sizes = {70, 80};
  run.head.token_block = 4;
  run.head.vocab_block = 32;
  run.head.chunk_tokens = 8;
  const HeadResult fresh = run_head(p, run);
  run.workspaces = &workspaces;
  const HeadResult reused = run_head(p, run);
  expect_matches(p, run, reused);
  EXPECT_EQ(std::memcmp(reused.loss.data(), fresh.loss.data(), fresh.loss.size() * sizeof(float)), 0);
  EXPECT_EQ(reused.grad_weight, fresh.grad_weight);
  EXPECT_EQ(reused.grad_bias, fresh.grad_bias);
  EXPECT_EQ(reused.hidden_parts, fresh.hidden_parts);
  for (const Workspace& w : workspaces) EXPECT_GT(w.capacity(), 0u);
}

TEST_P(HeadModes, AccumulatesIntoFp32AndReducesTheHiddenGradient) {
  HeadProblem p = random_head_problem(33, 20, 97, kFloat32, 5);
  HeadRun run;
  run.mode = GetParam();
  run.loss.reduction = Reduction::kSum;
  run.ranks = 2;
  run.accumulate = true;
  run.prefill = 0.25f;
  run.reduce_hidden = true;
  run.head.token_block = 16;
  run.head.vocab_block = 8;
  run.head.chunk_tokens = 16;
  expect_matches(p, run, run_head(p, run));
}

TEST_P(HeadModes, LargeAndMinusInfinityLogitsStayFinite) {
  HeadProblem p = random_head_problem(21, 12, 64, kFloat32, 9, 3000.0f);  // logits of about +-1e4
  for (int64_t v = 10; v < 20; ++v) p.set_bias(v, -std::numeric_limits<float>::infinity());
  for (int64_t& t : p.targets) {
    if (t >= 10 && t < 20) t = 31;  // on the shard boundary of 2 ranks
  }
  HeadRun run;
  run.mode = GetParam();
  run.loss.reduction = Reduction::kMean;
  run.ranks = 2;
  run.head.token_block = 4;
  run.head.vocab_block = 8;
  run.head.chunk_tokens = 8;
  const HeadResult r = run_head(p, run);
  expect_matches(p, run, r, 1e-6, 1e-5);
  for (double g : r.grad_hidden) ASSERT_TRUE(std::isfinite(g));
  for (double g : r.grad_weight) ASSERT_TRUE(std::isfinite(g));
}

// Label smoothing where every logit is large and they sit close together (a bias of 1e5 on
// every column, products of a few units on top, all multiples of 1/4 so that the fp32 logits
// are the oracle's exactly): the tiles' sums of logits are taken relative to their max and
// rebased as tiles, chunks and ranks fold, so the smoothed loss keeps its 1e-6 (as a plain
// fp32 sum of z it lost 2e-4 here). Uneven ranks (one of a single row), small tiles, both
// semantics; per-token losses in the recompute mode, their mean in the chunked one. The
// gradients, p - q with p from the float64 lse, keep the bar's 1e-5 too; from a float32 lse,
// whose spacing at 1e5 (2^-7) bounds p's accuracy (design.md, "Precision"), they do not
// (checked: what the float64 lse buys).
TEST_P(HeadModes, SmoothingWithLargeCloseTogetherLogitsKeepsItsAccuracy) {
  HeadProblem p = random_head_problem(13, 16, 300, kFloat32, 17, 3.0f);
  std::mt19937_64 rng(5);
  for (int64_t i = 0; i < p.tokens; ++i) {
    for (int64_t k = 0; k < p.hidden; ++k) p.set_hidden(i, k, static_cast<float>(static_cast<int>(rng() % 5) - 2));
  }
  for (int64_t v = 0; v < p.vocab; ++v) {
    for (int64_t k = 0; k < p.hidden; ++k) {
      const float w = static_cast<float>(static_cast<int>(rng() % 5) - 2) * 0.25f;
      std::memcpy(p.weight_storage.data() + (v * p.ld_weight + k) * 4, &w, sizeof(w));
    }
    p.set_bias(v, 1e5f + static_cast<float>(v % 3));
  }
  for (SmoothingSemantics semantics : {SmoothingSemantics::kMegatron, SmoothingSemantics::kPyTorch}) {
    HeadRun run;
    run.mode = GetParam();
    run.loss.label_smoothing = 0.1f;
    run.loss.smoothing_semantics = semantics;
    if (run.mode == Mode::kChunked) run.loss.reduction = Reduction::kMean;
    run.ranks = 3;
    run.sizes = {100, 1, 199};
    run.head.token_block = 4;
    run.head.vocab_block = 16;
    run.head.chunk_tokens = 8;
    const HeadResult r = run_head(p, run);
    expect_matches(p, run, r, 1e-6, 1e-5);
    run.lse_dtype = kFloat32;
    const HeadResult fp32_lse = run_head(p, run);
    expect_ok(fp32_lse);
    const HeadOracle o = head_oracle(p, run.loss, run.grad_scalar);
    EXPECT_GT(relative_error(fp32_lse.grad_weight, o.grad_weight), 1e-4);
    EXPECT_LE(relative_error(fp32_lse.grad_weight, o.grad_weight), 2e-2);
  }
}

// Megatron's legacy smoothing: each rank's loss smooths over its own rows of the weight, and
// its logit gradients (hence its part of the hidden gradient, its rows' weight and bias
// gradients) are those of its own loss: against the oracle of each rank's shard.
TEST_P(HeadModes, MegatronLegacySmoothingMatchesEachShardsOracle) {
  HeadProblem p = random_head_problem(23, 24, 301, kFloat32, 17);
  HeadRun run;
  run.mode = GetParam();
  run.loss.label_smoothing = 0.1f;
  run.loss.smoothing_semantics = SmoothingSemantics::kMegatronLegacy;
  if (run.mode == Mode::kChunked) {
    run.loss.reduction = Reduction::kMean;
    run.grad_scalar = 1.0f;  // the chunked mode's upstream gradient
  }
  run.ranks = 3;
  run.sizes = {120, 2, 179};
  run.head.token_block = 4;
  run.head.vocab_block = 16;
  run.head.chunk_tokens = 8;
  const HeadResult r = run_head(p, run);
  expect_ok(r);
  const std::vector<VocabShard> shards = shards_from_sizes(run.sizes);
  std::vector<double> grad_hidden(static_cast<std::size_t>(p.tokens * p.hidden), 0.0);
  std::vector<double> grad_weight(static_cast<std::size_t>(p.vocab * p.hidden)),
      grad_bias(static_cast<std::size_t>(p.vocab));
  for (int rank = 0; rank < run.ranks; ++rank) {
    const VocabShard& shard = shards[static_cast<std::size_t>(rank)];
    const HeadOracle o = head_oracle(p, run.loss, run.grad_scalar, false, &shard);
    EXPECT_LE(relative_error(widen(r.loss_of_rank[static_cast<std::size_t>(rank)]), o.loss.loss), 1e-6) << rank;
    for (int64_t v = shard.vocab_begin; v < shard.vocab_end; ++v) {
      grad_bias[static_cast<std::size_t>(v)] = o.grad_bias[static_cast<std::size_t>(v)];
      for (int64_t k = 0; k < p.hidden; ++k) {
        const auto vk = static_cast<std::size_t>(v * p.hidden + k);
        grad_weight[vk] = o.grad_weight[vk];
        for (int64_t i = 0; i < p.tokens; ++i) {
          grad_hidden[static_cast<std::size_t>(i * p.hidden + k)] +=
              o.loss.grad[static_cast<std::size_t>(i * p.vocab + v)] * p.weight_at(v, k);
        }
      }
    }
  }
  EXPECT_LE(relative_error(r.grad_hidden, grad_hidden), 1e-5);
  EXPECT_LE(relative_error(r.grad_weight, grad_weight), 1e-5);
  EXPECT_LE(relative_error(r.grad_bias, grad_bias), 1e-5);
  EXPECT_NE(r.loss_of_rank[0][0], r.loss_of_rank[2][0]);  // each rank its own smoothing, as in Megatron
}

// round_logits: the logits rounded to the operands' dtype, the product and then its sum with
// the bias, as a bf16 or fp16 layer rounds them. Exact products (integer hidden states,
// weights in 64ths) keep the GEMMs' fp32 sums exact, so every rounding is the oracle's.
TEST_P(HeadModes, RoundLogitsRoundsAsAHalfPrecisionLayerDoes) {
  for (DataType dtype : {kBFloat16, kFloat16}) {
    HeadProblem p = random_head_problem(21, 24, 230, dtype, 23);
    std::mt19937_64 rng(5);
    for (int64_t i = 0; i < p.tokens; ++i) {
      for (int64_t k = 0; k < p.hidden; ++k) p.set_hidden(i, k, static_cast<float>(static_cast<int>(rng() % 17) - 8));
    }
    for (int64_t v = 0; v < p.vocab; ++v) {
      for (int64_t k = 0; k < p.hidden; ++k) {
        const float w = static_cast<float>(static_cast<int>(rng() % 129) - 64) / 64.0f;
        detail::narrow(w, p.weight_storage.data() + (v * p.ld_weight + k) * dtype.bytes(), dtype);
      }
      p.set_bias(v, static_cast<float>(static_cast<int>(rng() % 41) - 20) * 0.3f);  // stored rounded
    }
    HeadRun run;
    run.mode = GetParam();
    if (run.mode == Mode::kChunked) run.loss.reduction = Reduction::kMean;
    run.ranks = 2;
    run.head.round_logits = true;
    run.head.token_block = 8;
    run.head.vocab_block = 32;
    run.head.chunk_tokens = 8;
    const HeadResult r = run_head(p, run);
    expect_ok(r);
    const HeadOracle o = head_oracle(p, run.loss, run.grad_scalar, false, nullptr, true);
    const char* name = dtype == kBFloat16 ? "bf16" : "fp16";
    EXPECT_LE(relative_error(widen(r.loss), o.loss.loss), 1e-6) << name;
    EXPECT_LE(relative_error(r.grad_hidden, o.grad_hidden), 1e-5) << name;
    EXPECT_LE(relative_error(r.grad_weight, o.grad_weight), 1e-5) << name;
    EXPECT_LE(relative_error(r.grad_bias, o.grad_bias), 1e-5) << name;
    // The exact logits give another loss: the rounding is there.
    const HeadOracle exact = head_oracle(p, run.loss, run.grad_scalar);
    EXPECT_GT(relative_error(widen(r.loss), exact.loss.loss), 1e-5) << name;
  }
}

TEST_P(HeadModes, EveryTokenIgnoredOrNoTokensGivesZeroGradients) {
  for (int64_t tokens : {int64_t{0}, int64_t{9}}) {
    HeadProblem p = random_head_problem(tokens, 8, 40, kFloat32, 3);
    for (int64_t& t : p.targets) t = -100;
    HeadRun run;
    run.mode = GetParam();
    run.loss.reduction = Reduction::kMean;
    run.ranks = 2;
    const HeadResult r = run_head(p, run);
    expect_ok(r);
    EXPECT_EQ(r.loss[0], 0.0f);
    for (double g : r.grad_hidden) EXPECT_EQ(g, 0.0);
    for (double g : r.grad_weight) EXPECT_EQ(g, 0.0);
  }
}

// A run of `mode` on two ranks: mean reduction, label smoothing 0.1, the given tiles and chunk.
HeadRun smoothed_mean_run(Mode mode, int64_t token_block, int64_t vocab_block, int64_t chunk_tokens) {
  HeadRun run;
  run.mode = mode;
  run.loss.reduction = Reduction::kMean;
  run.loss.label_smoothing = 0.1f;
  run.ranks = 2;
  run.head.token_block = token_block;
  run.head.vocab_block = vocab_block;
  run.head.chunk_tokens = chunk_tokens;
  return run;
}

TEST_P(HeadModes, HalfPrecisionInputsAndGradientsWithinTheirRounding) {
  for (DataType dtype : {kBFloat16, kFloat16}) {
    HeadProblem p = random_head_problem(40, 32, 120, dtype, 11);
    HeadRun run = smoothed_mean_run(GetParam(), 16, 32, 16);
    for_each_bf16_gemm([&] {
      run.grad_dtype = kFloat32;
      // fp32 gradients: only the fp32 GEMMs' rounding (the oracle reads the same stored values).
      expect_matches(p, run, run_head(p, run));
      run.grad_dtype = dtype;  // gradients written in the input's dtype: one rounding each
      const double tol = dtype == kBFloat16 ? 8e-3 : 1e-3;
      expect_matches(p, run, run_head(p, run), 1e-6, tol);
    });
  }
}

TEST_P(HeadModes, BitIdenticalForOneAndTwoThreadsAndAcrossRuns) {
  for (DataType dtype : {kFloat32, kBFloat16}) {
    HeadProblem p = random_head_problem(70, 40, 300, dtype, 21);
    HeadRun run = smoothed_mean_run(GetParam(), 16, 64, 32);
    for_each_bf16_gemm([&] {
      run.loss.num_threads = 1;
      const HeadResult one = run_head(p, run);
      run.loss.num_threads = 2;
      const HeadResult two = run_head(p, run), again = run_head(p, run);
      expect_ok(one);
      for (const HeadResult* r : {&two, &again}) {
        expect_ok(*r);
        EXPECT_EQ(std::memcmp(r->loss.data(), one.loss.data(), one.loss.size() * sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(r->lse.data(), one.lse.data(), one.lse.size() * sizeof(double)), 0);
        EXPECT_EQ(r->grad_weight, one.grad_weight);
        EXPECT_EQ(r->grad_bias, one.grad_bias);
        EXPECT_EQ(r->hidden_parts, one.hidden_parts);
      }
    });
  }
}

TEST_P(HeadModes, WideTilesSpanSeveralGradientSuperBlocks) {
  // Vb = 16384 columns: the backward holds 8 MiB of logit gradients, 16 token blocks of 8, so
  // 300 tokens take three super-blocks whose weight gradients are summed in order.
  // bf16: the super-blocks' hidden states are widened to fp32 in the same buffer (120 tokens).
  for (DataType dtype : {kFloat32, kBFloat16}) {
    HeadProblem p = random_head_problem(300, 6, 20000, dtype, 51);
    HeadRun run;
    run.mode = GetParam();
    run.loss.reduction = Reduction::kMean;
    run.ranks = 1;
    run.head.token_block = 8;
    run.head.vocab_block = 16384;
    run.head.chunk_tokens = 104;
    for_each_bf16_gemm([&] { expect_matches(p, run, run_head(p, run)); });
  }
}

// bf16_logit_gradients: added into fp32 gradients, wide tiles over several super-blocks, the
// default tiles; bit-identical for one and two threads and across runs.
TEST_P(HeadModes, Bf16LogitGradientsAccumulateAndAreBitIdenticalAcrossThreads) {
  struct Case {
    int64_t tokens, hidden, vocab, token_block, vocab_block, chunk_tokens;
  };
  // Small tiles; wide tiles over several gradient super-blocks; the default tiles.
  for (const Case& c :
       {Case{70, 40, 300, 16, 64, 32}, Case{300, 6, 20000, 8, 16384, 104}, Case{90, 48, 2100, 0, 0, 0}}) {
    HeadProblem p = random_head_problem(c.tokens, c.hidden, c.vocab, kBFloat16, 23);
    HeadRun run = smoothed_mean_run(GetParam(), c.token_block, c.vocab_block, c.chunk_tokens);
    run.head.bf16_logit_gradients = true;
    SCOPED_TRACE("vocab " + std::to_string(c.vocab));
    for_each_bf16_gemm([&] {
      run.loss.num_threads = 1;
      run.accumulate = true;
      run.prefill = 0.25f;
      const HeadResult one = run_head(p, run);
      expect_within_bf16_logit_rounding(p, run, one);
      run.loss.num_threads = 2;
      const HeadResult two = run_head(p, run), again = run_head(p, run);
      for (const HeadResult* r : {&two, &again}) {
        expect_ok(*r);
        EXPECT_EQ(std::memcmp(r->loss.data(), one.loss.data(), one.loss.size() * sizeof(float)), 0);
        EXPECT_EQ(r->grad_weight, one.grad_weight);
        EXPECT_EQ(r->grad_bias, one.grad_bias);
        EXPECT_EQ(r->hidden_parts, one.hidden_parts);
      }
      run.accumulate = false;
      run.grad_dtype = kBFloat16;  // written over in bf16: one more rounding each
      const HeadResult written = run_head(p, run);
      expect_ok(written);
      const HeadOracle o = head_oracle(p, run.loss, run.grad_scalar);
      EXPECT_LE(relative_error(written.grad_hidden, o.grad_hidden), 1.6e-2);
      EXPECT_LE(relative_error(written.grad_weight, o.grad_weight), 1.6e-2);
      run.grad_dtype = kFloat32;
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Head, HeadModes, ::testing::Values(Mode::kRecompute, Mode::kChunked),
                         [](const auto& info) { return info.param == Mode::kRecompute ? "Recompute" : "Chunked"; });

TEST(Head, ChunkedLossIsTheForwardsBitForBitAndCountsItsGathers) {
  for (DataType dtype : {kFloat32, kBFloat16}) {
    HeadProblem p = random_head_problem(50, 16, 90, dtype, 31);
    for_each_bf16_gemm([&] {
      HeadRun run;
      run.loss.reduction = Reduction::kSum;
      run.ranks = 2;
      run.head.token_block = 8;
      run.head.vocab_block = 16;
      run.head.chunk_tokens = 16;
      const HeadResult recompute = run_head(p, run);
      run.mode = Mode::kChunked;
      const HeadResult chunked = run_head(p, run);
      expect_ok(chunked);
      EXPECT_EQ(chunked.collectives, 4);  // ceil(50 / 16)
      EXPECT_EQ(std::memcmp(chunked.loss.data(), recompute.loss.data(), sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(chunked.lse.data(), recompute.lse.data(), recompute.lse.size() * sizeof(double)), 0);
    });
  }
}

uint16_t bf16_bits(float value) {
  uint16_t bits = 0;
  detail::narrow(value, &bits, kBFloat16);
  return bits;
}
float bf16_value(uint16_t bits) { return detail::widen(&bits, kBFloat16); }

// The default tiles, with more vocabulary rows than one tile (the GEMM's output row stride then
// differs between a tile of its own and the chunk's logits, and oneDNN may round differently):
// the chunked mode still gives the forward's loss and lse bit for bit.
TEST(Head, ChunkedLossIsTheForwardsBitForBitWithTheDefaultTiles) {
  struct Case {
    int64_t tokens, hidden, vocab, token_block, vocab_block;
  };
  for (const Case& c : {Case{600, 512, 3000, 0, 0}, Case{64, 40, 30, 8, 15}}) {
    for (DataType dtype : {kFloat32, kBFloat16, kFloat16}) {
      HeadProblem p = random_head_problem(c.tokens, c.hidden, c.vocab, dtype, 41);
      for_each_bf16_gemm([&] {
        HeadRun run;
        run.loss.reduction = Reduction::kSum;
        run.head.token_block = c.token_block;
        run.head.vocab_block = c.vocab_block;
        const HeadResult recompute = run_head(p, run);
        run.mode = Mode::kChunked;
        const HeadResult chunked = run_head(p, run);
        expect_ok(recompute);
        expect_ok(chunked);
        SCOPED_TRACE("N " + std::to_string(c.tokens) + " H " + std::to_string(c.hidden) + " V " +
                     std::to_string(c.vocab) + " " + to_string(dtype));
        EXPECT_EQ(std::memcmp(chunked.loss.data(), recompute.loss.data(), sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(chunked.lse.data(), recompute.lse.data(), recompute.lse.size() * sizeof(double)), 0);
      });
    }
  }
}

// Uneven ranges with the default chunk: the ranks' own [chunk, V_r] budgets would give them
// chunks of 1664 and 33280 tokens; the chunk comes from ceil(V / R) instead (3264), so they
// make the same one gather and the loss is the recompute forward's.
TEST(Head, UnevenRangesAgreeOnTheDefaultChunk) {
  HeadProblem p = random_head_problem(2000, 4, 20500, kFloat32, 43, 3.0f, /*with_bias=*/false);
  HeadRun run;
  run.loss.reduction = Reduction::kMean;
  run.ranks = 2;
  run.sizes = {20000, 500};
  run.head.token_block = 64;
  const HeadResult recompute = run_head(p, run);
  run.mode = Mode::kChunked;
  const HeadResult chunked = run_head(p, run);
  expect_ok(recompute);
  expect_ok(chunked);
  EXPECT_EQ(chunked.collectives, 1);
  EXPECT_EQ(std::memcmp(chunked.loss.data(), recompute.loss.data(), sizeof(float)), 0);
}

// gemm_bf16 against the fp64 products of the same bf16 values, A and B each as stored or
// transposed, written over and added into, with strided and misaligned rows: within fp32
// summation's bound (k + 1) 2^-24 (sum |a b| + |c|) (the products are exact). oneDNN's bf16
// matmul here (emulated on AVX-512 without BF16); its own widening where oneDNN has none,
// which the ctest HeadBf16GemmsWithoutAvx512 runs (ONEDNN_MAX_CPU_ISA=AVX2).
TEST(HeadGemm, Bf16ProductsSummedInFp32WithinTheirBound) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const auto& [m, n, k] :
       std::vector<std::array<int64_t, 3>>{{37, 29, 301}, {1, 1, 1}, {16, 64, 1024}, {5, 3, 0}}) {
    for (int layout = 0; layout < 8; ++layout) {
      const bool trans_a = (layout & 1) != 0, trans_b = (layout & 2) != 0, add = (layout & 4) != 0;
      // A is stored [m, k] or (trans_a) [k, m]; B [k, n] or (trans_b) [n, k].
      const int64_t lda = (trans_a ? m : k) + 3, ldb = (trans_b ? k : n) + 5, ldc = n + 2;
      std::vector<uint16_t> a(static_cast<std::size_t>((trans_a ? k : m) * lda + 1)),
          b(static_cast<std::size_t>((trans_b ? n : k) * ldb + 1));
      for (uint16_t& x : a) x = bf16_bits(normal(rng) * 10.0f);
      for (uint16_t& x : b) x = bf16_bits(normal(rng));
      std::vector<float> start(static_cast<std::size_t>(m * ldc));
      for (float& x : start) x = add ? normal(rng) * 100.0f : NAN;  // never read when written over
      auto a_at = [&](int64_t i, int64_t q) {
        return double{bf16_value(a[static_cast<std::size_t>(1 + (trans_a ? q * lda + i : i * lda + q))])};
      };
      auto b_at = [&](int64_t q, int64_t j) {
        return double{bf16_value(b[static_cast<std::size_t>(1 + (trans_b ? j * ldb + q : q * ldb + j))])};
      };
      {
        std::vector<float> c = start;
        // One element past the start: no row aligned.
        detail::gemm_bf16(trans_a, trans_b, m, n, k, a.data() + 1, lda, b.data() + 1, ldb, add ? 1.0f : 0.0f, c.data(),
                          ldc);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            const double old = add ? double{start[static_cast<std::size_t>(i * ldc + j)]} : 0.0;
            double exact = old, magnitude = std::fabs(old);
            for (int64_t q = 0; q < k; ++q) {
              const double product = a_at(i, q) * b_at(q, j);
              exact += product;
              magnitude += std::fabs(product);
            }
            ASSERT_LE(std::fabs(c[static_cast<std::size_t>(i * ldc + j)] - exact),
                      static_cast<double>(k + 1) * 0x1p-24 * magnitude + 1e-30)
                << "m " << m << " n " << n << " k " << k << " layout " << layout << " at " << i << ", " << j;
          }
        }
      }
    }
  }
}

TEST(HeadGemm, Bf16DotProductsAreUsedWhereTheCpuHasThemUnlessTurnedOff) {
  if (std::getenv("ONEDNN_MAX_CPU_ISA") == nullptr && std::getenv("DNNL_MAX_CPU_ISA") == nullptr) {
    EXPECT_EQ(detail::bf16_gemm_native(), detail::cpu_has_avx512_bf16());
  }
  detail::set_bf16_instructions_allowed(false);
  EXPECT_FALSE(detail::bf16_gemm_native());
  detail::set_bf16_instructions_allowed(true);
}

TEST(Head, OneAllGatherPerForwardAndOnePerChunk) {
  HeadProblem p = random_head_problem(40, 8, 60, kFloat32, 61);
  const std::vector<VocabShard> shards = shards_from_sizes({25, 35});
  std::unique_ptr<ThreadGroup> g;
  ASSERT_TRUE(ThreadGroup::create(2, &g).ok());
  std::vector<int> forward_gathers(2), chunked_gathers(2);
  const std::vector<Status> st = g->run([&](Communicator& comm) -> Status {
    const VocabShard& shard = shards[static_cast<std::size_t>(comm.rank())];
    const HeadInputs in{p.hidden_view(), p.weight_view(shard.vocab_begin, shard.vocab_end)};
    const TensorView tv = TensorView::contiguous(p.targets.data(), kInt64, {p.tokens});
    std::vector<float> loss(1), lse(static_cast<std::size_t>(p.tokens));
    std::vector<float> gh(static_cast<std::size_t>(p.tokens * p.hidden));
    const TensorView ghv = TensorView::contiguous(gh.data(), kFloat32, {p.tokens, p.hidden});
    LossOptions options;
    options.reduction = Reduction::kSum;
    HeadOptions head;
    head.token_block = 8;
    head.chunk_tokens = 16;
    CountingCommunicator counting(comm);
    Status s = linear_cross_entropy_forward(counting, in, tv, shard, options, head,
                                            TensorView::contiguous(loss.data(), kFloat32, {1}),
                                            TensorView::contiguous(lse.data(), kFloat32, {p.tokens}));
    forward_gathers[static_cast<std::size_t>(comm.rank())] = counting.calls;
    if (!s.ok()) return s;
    CountingCommunicator chunked(comm);
    s = linear_cross_entropy_forward_backward(
        chunked, in, tv, shard, options, head, 1.0f, TensorView::contiguous(loss.data(), kFloat32, {1}),
        TensorView::contiguous(lse.data(), kFloat32, {p.tokens}), {{&ghv, false}});
    chunked_gathers[static_cast<std::size_t>(comm.rank())] = chunked.calls;
    return s;
  });
  for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(forward_gathers, (std::vector<int>{1, 1}));  // the backward takes no communicator
  EXPECT_EQ(chunked_gathers, (std::vector<int>{3, 3}));  // ceil(40 / 16)
}

TEST(Head, StagedStatsMatchTheLossOfTheLogits) {
  // linear_cross_entropy_local_stats, merged and reduced with the staged API, gives the loss
  // of the oracle's logits.
  HeadProblem p = random_head_problem(19, 8, 50, kFloat32, 41);
  const LossOptions options;
  const VocabShard shard{0, 50, 50};
  TensorView bias = p.bias_view(0, 50);
  const HeadInputs in{p.hidden_view(), p.weight_view(0, 50), &bias};
  const TensorView tv = TensorView::contiguous(p.targets.data(), kInt64, {p.tokens});
  std::vector<float> stats(static_cast<std::size_t>(p.tokens * 4)), merged(stats.size());
  std::vector<float> loss(static_cast<std::size_t>(p.tokens)), lse(loss.size());
  ASSERT_TRUE(linear_cross_entropy_local_stats(in, tv, shard, options, {},
                                               TensorView::contiguous(stats.data(), kFloat32, {p.tokens, 4}))
                  .ok());
  ASSERT_TRUE(merge_stats(TensorView::contiguous(stats.data(), kFloat32, {1, p.tokens, 4}), options,
                          TensorView::contiguous(merged.data(), kFloat32, {p.tokens, 4}))
                  .ok());
  ASSERT_TRUE(calculate_loss(TensorView::contiguous(merged.data(), kFloat32, {p.tokens, 4}), tv, 50, options,
                             TensorView::contiguous(loss.data(), kFloat32, {p.tokens}),
                             TensorView::contiguous(lse.data(), kFloat32, {p.tokens}))
                  .ok());
  const HeadOracle o = head_oracle(p, options, 1.0f);
  EXPECT_LE(relative_error(widen(loss), o.loss.loss), 1e-6);
}

// ---- bad arguments ----------------------------------------------------------------------

struct Fixture {
  HeadProblem p = random_head_problem(6, 4, 10, kFloat32, 2);
  VocabShard shard{0, 10, 10};
  std::vector<float> loss = std::vector<float>(6), lse = std::vector<float>(6), gl = std::vector<float>(6, 1.0f);
  std::vector<float> gh = std::vector<float>(24), gw = std::vector<float>(40);
  TensorView hidden = p.hidden_view(), weight = p.weight_view(0, 10);
  TensorView targets = TensorView::contiguous(p.targets.data(), kInt64, {6});
  TensorView loss_v = TensorView::contiguous(loss.data(), kFloat32, {6});
  TensorView lse_v = TensorView::contiguous(lse.data(), kFloat32, {6});
  TensorView gl_v = TensorView::contiguous(gl.data(), kFloat32, {6});
  TensorView gh_v = TensorView::contiguous(gh.data(), kFloat32, {6, 4});
  TensorView gw_v = TensorView::contiguous(gw.data(), kFloat32, {10, 4});
};

Status forward_on_one(Fixture& f, const HeadInputs& in, const HeadOptions& head = {}) {
  std::unique_ptr<ThreadGroup> g;
  EXPECT_TRUE(ThreadGroup::create(1, &g).ok());
  return g->run([&](Communicator& comm) {
    return linear_cross_entropy_forward(comm, in, f.targets, f.shard, {}, head, f.loss_v, f.lse_v);
  })[0];
}

void expect_error(const Status& s, const std::string& fragment) {
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
}

// A NaN upstream gradient. In the recompute mode it is data (the tensor autograd hands the
// backward): as in PyTorch it reaches its token's row of the hidden states' gradient and,
// through the sums over tokens, every element of the weight's and the bias's, and no other
// hidden row. The chunked mode's grad_loss is an argument: NaN or inf is refused by name on
// every rank.
TEST(Head, ANanUpstreamGradientIsDataInTheRecomputeModeAndRefusedInTheChunkedOne) {
  HeadProblem p = random_head_problem(6, 16, 48, kFloat32, 12);
  p.targets[1] = 5;  // not ignored (an ignored token's gradient is 0 whatever its upstream)
  p.grad_loss[1] = 0.0f;
  HeadRun run;
  run.ranks = 2;
  const HeadOracle want = head_oracle(p, run.loss, run.grad_scalar);
  p.grad_loss[1] = std::numeric_limits<float>::quiet_NaN();
  const HeadResult r = run_head(p, run);
  expect_ok(r);
  double largest = 0.0, off = 0.0;
  for (int64_t i = 0; i < p.tokens; ++i) {
    for (int64_t k = 0; k < p.hidden; ++k) {
      const double got = r.grad_hidden[static_cast<std::size_t>(i * p.hidden + k)];
      const double exact = want.grad_hidden[static_cast<std::size_t>(i * p.hidden + k)];
      if (i == 1) {
        EXPECT_TRUE(std::isnan(got)) << "feature " << k;
      } else {
        largest = std::max(largest, std::fabs(exact));
        off = std::max(off, std::fabs(got - exact));
      }
    }
  }
  EXPECT_LE(off, 1e-5 * largest);
  for (double g : r.grad_weight) ASSERT_TRUE(std::isnan(g));
  for (double g : r.grad_bias) ASSERT_TRUE(std::isnan(g));

  run.mode = Mode::kChunked;
  run.loss.reduction = Reduction::kSum;
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    run.grad_scalar = bad;
    for (const Status& s : run_head(p, run).status) {
      EXPECT_FALSE(s.ok());  // (rank 1 reports rank 0's error, the first)
      EXPECT_NE(s.message().find("grad_loss: expected a finite value, got "), std::string::npos) << s.message();
    }
  }
}

TEST(HeadErrors, NameTheArgumentTheExpectedAndTheActualValue) {
  Fixture f;
  const TensorView narrow_weight = TensorView::matrix(f.p.weight_base(), kFloat32, 10, 3, f.p.ld_weight);
  expect_error(forward_on_one(f, {f.hidden, narrow_weight}), "weight.shape[1]: expected 4 (hidden's H), got 3");
  const TensorView short_weight = f.p.weight_view(0, 9);
  expect_error(forward_on_one(f, {f.hidden, short_weight}), "weight.shape[0]: expected 10");
  const TensorView bf16_weight = TensorView::matrix(f.p.weight_base(), kBFloat16, 10, 4, f.p.ld_weight);
  expect_error(forward_on_one(f, {f.hidden, bf16_weight}),
               "weight.dtype: expected float32 (hidden's dtype), got bfloat16");
  const TensorView short_bias = f.p.bias_view(0, 9);
  expect_error(forward_on_one(f, {f.hidden, f.weight, &short_bias}),
               "bias.shape: expected 10 elements (one per weight row), got 9 elements");
  HeadOptions odd;
  odd.chunk_tokens = 100;
  odd.token_block = 64;
  expect_error(forward_on_one(f, {f.hidden, f.weight}, odd),
               "head.chunk_tokens: expected a multiple of the token block 64");
  odd = {};
  odd.vocab_block = -1;
  expect_error(forward_on_one(f, {f.hidden, f.weight}, odd), "head.vocab_block");
  odd = {};
  odd.bf16_logit_gradients = true;
  expect_error(forward_on_one(f, {f.hidden, f.weight}, odd),
               "head.bf16_logit_gradients: expected false for float32 operands (bfloat16 only), got true");

  // Gradients: accumulate needs fp32; no overlap with an input; grad_bias needs a bias.
  std::vector<uint16_t> half(24);
  const TensorView half_gh = TensorView::contiguous(half.data(), kBFloat16, {6, 4});
  const HeadInputs in{f.hidden, f.weight};
  auto backward_with = [&](const HeadGradients& g) {
    return linear_cross_entropy_backward(in, f.targets, f.lse_v, f.gl_v, f.shard, {}, {}, g);
  };
  expect_error(backward_with({{&half_gh, true}}),
               "grad_hidden.dtype: expected float32 (accumulate adds into fp32), got bfloat16");
  expect_error(backward_with({{&f.hidden, false}}), "grad_hidden: expected memory that does not overlap hidden");
  expect_error(backward_with({{&f.gh_v, false}, {&f.gh_v, false}}), "grad_weight.shape");
  expect_error(backward_with({{}, {}, {&f.gl_v, false}}), "grad_bias: expected null (there is no bias)");
  // The chunked mode needs a reduced loss.
  std::unique_ptr<ThreadGroup> g;
  ASSERT_TRUE(ThreadGroup::create(1, &g).ok());
  const Status s = g->run([&](Communicator& comm) {
    return linear_cross_entropy_forward_backward(comm, in, f.targets, f.shard, {}, {}, 1.0f, f.loss_v, f.lse_v,
                                                 {{&f.gh_v, false}, {&f.gw_v, false}});
  })[0];
  expect_error(s, "options.reduction: expected sum or mean");
  // Nothing was written on any error.
  for (float x : f.gh) EXPECT_EQ(x, 0.0f);
  for (float x : f.loss) EXPECT_EQ(x, 0.0f);
}

TEST(HeadErrors, RanksThatDisagreeOnTheHiddenSizeAllFailAlike) {
  HeadProblem p = random_head_problem(6, 8, 20, kFloat32, 4);
  std::unique_ptr<ThreadGroup> g;
  ASSERT_TRUE(ThreadGroup::create(2, &g).ok());
  const std::vector<VocabShard> shards = shards_from_sizes({10, 10});
  const std::vector<Status> st = g->run([&](Communicator& comm) {
    const VocabShard& shard = shards[static_cast<std::size_t>(comm.rank())];
    const int64_t h = comm.rank() == 0 ? 8 : 6;  // rank 1 uses the first 6 features only
    const TensorView hidden = TensorView::matrix(p.hidden_base(), kFloat32, 6, h, p.ld_hidden);
    const TensorView weight =
        TensorView::matrix(p.weight_base() + shard.vocab_begin * p.ld_weight * 4, kFloat32, 10, h, p.ld_weight);
    std::vector<float> loss(6), lse(6);
    return linear_cross_entropy_forward(comm, {hidden, weight}, TensorView::contiguous(p.targets.data(), kInt64, {6}),
                                        shard, {}, {}, TensorView::contiguous(loss.data(), kFloat32, {6}),
                                        TensorView::contiguous(lse.data(), kFloat32, {6}));
  });
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), Code::kInvalidUsage);
    EXPECT_NE(s.message().find("ranks disagree on the hidden size of the fused head: expected rank 0's 8"),
              std::string::npos)
        << s.message();
  }
}

// Rank 0 calls the recompute forward, rank 1 the chunked mode with one chunk of all the
// tokens (so that the gathers have one size): both return the mode's disagreement, not the
// targets' or the token count's.
// The chunked mode, ranks whose first chunks agree but whose token counts (32 and 48 in
// chunks of 16) or upstream gradients (1 and 1000) differ: every rank is told which, at the
// first gather (the gradient's scale went unnoticed, the count was blamed on the targets).
TEST(HeadErrors, ChunkedRanksThatDisagreeOnTheTokensOrTheUpstreamGradientAllFailAlike) {
  HeadProblem p = random_head_problem(48, 8, 20, kFloat32, 7);
  const std::vector<VocabShard> shards = shards_from_sizes({10, 10});
  for (bool tokens : {true, false}) {
    std::unique_ptr<ThreadGroup> g;
    ASSERT_TRUE(ThreadGroup::create(2, &g).ok());
    int gathers[2] = {0, 0};
    const std::vector<Status> st = g->run([&](Communicator& comm) {
      const int r = comm.rank();
      const VocabShard& shard = shards[static_cast<std::size_t>(r)];
      const int64_t n = tokens && r == 1 ? 48 : 32;
      const TensorView hidden = TensorView::matrix(p.hidden_base(), kFloat32, n, 8, p.ld_hidden);
      const TensorView weight =
          TensorView::matrix(p.weight_base() + shard.vocab_begin * p.ld_weight * 4, kFloat32, 10, 8, p.ld_weight);
      std::vector<float> loss(1), lse(static_cast<std::size_t>(n)), gw(10 * 8);
      const TensorView gwv = TensorView::contiguous(gw.data(), kFloat32, {10, 8});
      LossOptions options;
      options.reduction = Reduction::kSum;
      HeadOptions head;
      head.token_block = 8;
      head.chunk_tokens = 16;
      int64_t collectives = 0;
      const Status s = linear_cross_entropy_forward_backward(
          comm, {hidden, weight}, TensorView::contiguous(p.targets.data(), kInt64, {n}), shard, options, head,
          !tokens && r == 1 ? 1000.0f : 1.0f, TensorView::contiguous(loss.data(), kFloat32, {1}),
          TensorView::contiguous(lse.data(), kFloat32, {n}), {{}, {&gwv, false}, {}}, {}, nullptr, &collectives);
      gathers[r] = static_cast<int>(collectives);
      return s;
    });
    const std::string want = tokens ? "ranks disagree on the number of tokens: expected rank 0's 32 on every rank, "
                                      "got 48 on rank 1"
                                    : "ranks disagree on grad_loss (the chunked mode's upstream gradient): expected "
                                      "rank 0's 1 on every rank, got 1000 on rank 1";
    for (const Status& s : st) {
      EXPECT_EQ(s.code(), Code::kInvalidUsage);
      EXPECT_NE(s.message().find(want), std::string::npos) << s.message();
    }
    EXPECT_EQ(gathers[0], 1);  // told at the first gather
    EXPECT_EQ(gathers[1], 1);
  }
}

TEST(HeadErrors, RanksThatDisagreeOnTheModeAllFailAlike) {
  HeadProblem p = random_head_problem(40, 8, 20, kFloat32, 6);
  std::unique_ptr<ThreadGroup> g;
  ASSERT_TRUE(ThreadGroup::create(2, &g).ok());
  const std::vector<VocabShard> shards = shards_from_sizes({10, 10});
  const std::vector<Status> st = g->run([&](Communicator& comm) {
    const VocabShard& shard = shards[static_cast<std::size_t>(comm.rank())];
    const TensorView weight =
        TensorView::matrix(p.weight_base() + shard.vocab_begin * p.ld_weight * 4, kFloat32, 10, 8, p.ld_weight);
    const TensorView targets = TensorView::contiguous(p.targets.data(), kInt64, {40});
    std::vector<float> loss(40), lse(40), gh(40 * 8);
    const TensorView lse_v = TensorView::contiguous(lse.data(), kFloat32, {40});
    LossOptions options;
    options.reduction = Reduction::kSum;
    HeadOptions head;
    head.token_block = 8;
    head.chunk_tokens = 48;
    if (comm.rank() == 0) {
      return linear_cross_entropy_forward(comm, {p.hidden_view(), weight}, targets, shard, options, head,
                                          TensorView::contiguous(loss.data(), kFloat32, {1}), lse_v);
    }
    const TensorView ghv = TensorView::contiguous(gh.data(), kFloat32, {40, 8});
    return linear_cross_entropy_forward_backward(comm, {p.hidden_view(), weight}, targets, shard, options, head, 1.0f,
                                                 TensorView::contiguous(loss.data(), kFloat32, {1}), lse_v,
                                                 {{&ghv, false}, {}, {}});
  });
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), Code::kInvalidUsage);
    EXPECT_NE(s.message().find("ranks disagree on the fused head's mode: expected rank 0's recompute "
                               "(linear_cross_entropy_forward) on every rank, got chunked "
                               "(linear_cross_entropy_forward_backward) on rank 1"),
              std::string::npos)
        << s.message();
  }
}

// One rank's bad target in the chunked mode with several chunks: the failing rank joins the
// first gather with the same size as the others, so both return its error, with the same
// text (the other rank's as a remote error), and neither writes its outputs.
TEST(HeadErrors, ABadTargetOnOneRankOfTheChunkedModeFailsEveryRankAlike) {
  HeadProblem p = random_head_problem(100, 8, 20, kFloat32, 5);
  std::unique_ptr<ThreadGroup> g;
  ASSERT_TRUE(ThreadGroup::create(2, &g).ok());
  const std::vector<VocabShard> shards = shards_from_sizes({10, 10});
  std::vector<std::vector<float>> losses(2, std::vector<float>(1, -7.0f));
  std::vector<int64_t> collectives(2, -1);
  const std::vector<Status> st = g->run([&](Communicator& comm) {
    const VocabShard& shard = shards[static_cast<std::size_t>(comm.rank())];
    std::vector<int64_t> targets = p.targets;
    if (comm.rank() == 1) targets[3] = 20;  // out of [0, V)
    const TensorView weight =
        TensorView::matrix(p.weight_base() + shard.vocab_begin * p.ld_weight * 4, kFloat32, 10, 8, p.ld_weight);
    std::vector<float> lse(100), gh(100 * 8);
    const TensorView ghv = TensorView::contiguous(gh.data(), kFloat32, {100, 8});
    HeadOptions head;
    head.token_block = 8;
    head.chunk_tokens = 16;  // seven gathers
    LossOptions options;
    options.reduction = Reduction::kSum;
    return linear_cross_entropy_forward_backward(
        comm, {p.hidden_view(), weight}, TensorView::contiguous(targets.data(), kInt64, {100}), shard, options, head,
        1.0f, TensorView::contiguous(losses[static_cast<std::size_t>(comm.rank())].data(), kFloat32, {1}),
        TensorView::contiguous(lse.data(), kFloat32, {100}), {{&ghv, false}, {}, {}}, {}, nullptr,
        &collectives[static_cast<std::size_t>(comm.rank())]);
  });
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(collectives, (std::vector<int64_t>{1, 1}));  // the first gather, which agreed the error
  EXPECT_EQ(st[1].code(), Code::kInvalidArgument) << st[1].message();
  EXPECT_EQ(st[0].code(), Code::kRemoteError) << st[0].message();
  // The same text on both ranks, as for the forward.
  EXPECT_EQ(st[0].message(), st[1].message());
  EXPECT_EQ(st[1].message().rfind("rank 1 of 2: invalid argument: targets: ", 0), 0u) << st[1].message();
  for (const auto& l : losses) EXPECT_EQ(l[0], -7.0f);
}

// One rank's bad grad_hidden: every rank gets its error, in the same text (the others only
// learnt that it "could not be reduced").
TEST(HeadErrors, TheHiddenGradientsReductionTellsEveryRankWhyOneFailed) {
  std::unique_ptr<ThreadGroup> g;
  ASSERT_TRUE(ThreadGroup::create(2, &g).ok());
  std::vector<float> parts[2] = {std::vector<float>(12, 1.0f), std::vector<float>(12, 1.0f)};
  const std::vector<Status> st = g->run([&](Communicator& comm) {
    const int r = comm.rank();
    return all_reduce_hidden_gradient(comm,
                                      TensorView::contiguous(parts[r].data(), r == 1 ? kBFloat16 : kFloat32, {3, 4}));
  });
  EXPECT_EQ(st[1].code(), Code::kInvalidArgument) << st[1].message();
  EXPECT_EQ(st[0].code(), Code::kRemoteError) << st[0].message();
  EXPECT_EQ(st[0].message(), st[1].message());
  EXPECT_EQ(st[0].message(), "rank 1 of 2: invalid argument: grad_hidden.dtype: expected float32, got bfloat16");
  for (float x : parts[0]) EXPECT_EQ(x, 1.0f);  // nothing reduced
}

TEST(HeadErrors, TheHiddenGradientOfNoFeaturesReducesToNothing) {
  std::unique_ptr<ThreadGroup> g;
  ASSERT_TRUE(ThreadGroup::create(2, &g).ok());
  const std::vector<Status> st = g->run([&](Communicator& comm) {
    std::vector<float> none;
    return all_reduce_hidden_gradient(comm, TensorView::contiguous(none.data(), kFloat32, {5, 0}));
  });
  for (const Status& s : st) EXPECT_TRUE(s.ok()) << s.message();
}

}  // namespace
}  // namespace vpce::test
