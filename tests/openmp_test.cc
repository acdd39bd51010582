// tests/openmp_test.cc: every public entry called from inside the caller's own OpenMP teams
// of 1 to 8 threads, each thread on its own problem, as a C++ trainer that parallelises
// over micro-batches calls vpce: the loss (one call and staged, in place and not), the
// fused head (local statistics, recompute forward and backward, chunked) and the row
// kernels, each with num_threads 1, 2 and OpenMP's default, with nested parallelism off (the
// default) and on. Each case runs once outside any team and is checked against the fp64
// oracle there; inside the teams every thread's outputs must be that run's, bit for bit
// (vpce's results never depend on the threads).
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "head_support.h"
#include "support.h"
#include "vpce/head.h"
#include "vpce/rows.h"

namespace vpce::test {
namespace {

// A case's outputs as one vector of doubles (NaN where an output is NaN), compared bitwise.
using Outputs = std::vector<double>;

struct Case {
  std::string name;
  std::function<Outputs()> run;               // the call, on this thread
  std::function<void(const Outputs&)> check;  // its outputs against the oracle
};

void append(Outputs& out, const std::vector<double>& v) { out.insert(out.end(), v.begin(), v.end()); }
void append(Outputs& out, const std::vector<float>& v) { append(out, widen(v)); }

bool same_bits(const Outputs& a, const Outputs& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// The loss on one rank (Loopback) through run_rank: loss, lse and gradient.
Case loss_case(DataType dtype, bool in_place, bool staged, int num_threads) {
  RunOptions options;
  options.in_place = in_place;
  options.staged = staged;
  options.loss.num_threads = num_threads;
  options.loss.label_smoothing = 0.1f;
  auto run = [=]() {
    Problem p = random_problem(37, 1000, dtype, 17);
    RunResult r = empty_result(1, p.tokens, false);
    std::vector<std::byte> grad = grad_buffer(p, options);
    Loopback solo;
    const Status s = run_rank(solo, p, {0, p.vocab, p.vocab}, options, &r.per_rank[0], grad.data());
    EXPECT_TRUE(s.ok()) << s.to_string();
    Outputs out;
    append(out, r.per_rank[0].loss);
    append(out, r.per_rank[0].lse);
    append(out, gathered_grad(p, options, grad));
    return out;
  };
  auto check = [=](const Outputs& got) {
    const Problem p = random_problem(37, 1000, dtype, 17);
    const reference::Result want = oracle(p, options);
    const std::size_t n = 37;
    const Outputs loss(got.begin(), got.begin() + n), lse(got.begin() + n, got.begin() + 2 * n);
    const Outputs grad(got.begin() + 2 * n, got.end());
    EXPECT_LE(relative_error(loss, want.loss), 1e-6);
    EXPECT_LE(relative_error(lse, want.lse), 1e-6);
    EXPECT_LE(relative_error(grad, want.grad), dtype == kFloat32 ? 1e-5 : 1e-2);
  };
  return {std::string("loss ") + to_string(dtype) + (in_place ? " in place" : " out of place") +
              (staged ? " staged" : "") + " num_threads " + std::to_string(num_threads),
          run, check};
}

// The fused head on one rank, on the calling thread.
Case head_case(DataType dtype, Mode mode, int num_threads) {
  HeadRun run;
  run.mode = mode;
  run.loss.num_threads = num_threads;
  run.loss.reduction = mode == Mode::kChunked ? Reduction::kMean : Reduction::kNone;
  run.head.token_block = 8;
  run.head.vocab_block = 16;
  run.head.chunk_tokens = 16;
  run.on_calling_thread = true;
  auto problem = [=] { return random_head_problem(37, 24, 203, dtype, 29); };
  auto call = [=]() {
    HeadProblem p = problem();
    const HeadResult r = run_head(p, run);
    expect_ok(r);
    Outputs out;
    append(out, r.loss);
    append(out, r.lse);
    append(out, r.grad_hidden);
    append(out, r.grad_weight);
    append(out, r.grad_bias);
    return out;
  };
  auto check = [=](const Outputs&) {
    HeadProblem p = problem();
    expect_matches(p, run, run_head(p, run));
  };
  return {std::string("head ") + to_string(dtype) + (mode == Mode::kChunked ? " chunked" : " recompute") +
              " num_threads " + std::to_string(num_threads),
          call, check};
}

// linear_cross_entropy_local_stats on default tiles (512 tokens a block: one block here),
// against calculate_local_stats of the logits the oracle makes.
Case head_stats_case(int num_threads) {
  auto call = [=]() {
    HeadProblem p = random_head_problem(300, 32, 700, kFloat32, 41);
    LossOptions options;
    options.num_threads = num_threads;
    const TensorView bias = p.bias_view(0, p.vocab);
    const HeadInputs in{p.hidden_view(), p.weight_view(0, p.vocab), &bias};
    std::vector<float> stats(static_cast<std::size_t>(p.tokens * 4), NAN);
    const Status s = linear_cross_entropy_local_stats(in, TensorView::contiguous(p.targets.data(), kInt64, {p.tokens}),
                                                      {0, p.vocab, p.vocab}, options, {},
                                                      TensorView::contiguous(stats.data(), kFloat32, {p.tokens, 4}));
    EXPECT_TRUE(s.ok()) << s.to_string();
    return widen(stats);
  };
  auto check = [](const Outputs& got) {
    HeadProblem p = random_head_problem(300, 32, 700, kFloat32, 41);
    const HeadOracle o = head_oracle(p, {}, 1.0f);
    // Statistics of the oracle's logits, rounded to fp32, by the loss's own kernels.
    std::vector<float> logits(o.logits.begin(), o.logits.end()), want(static_cast<std::size_t>(p.tokens * 4));
    ASSERT_TRUE(calculate_local_stats(TensorView::contiguous(logits.data(), kFloat32, {p.tokens, p.vocab}),
                                      TensorView::contiguous(p.targets.data(), kInt64, {p.tokens}),
                                      {0, p.vocab, p.vocab}, {},
                                      TensorView::contiguous(want.data(), kFloat32, {p.tokens, 4}))
                    .ok());
    // Column by column (max, sum of exponentials, target logit, sum of logits): the same
    // infinity (an ignored or unowned target), else within 1e-5 of the column's largest.
    for (int64_t c = 0; c < 4; ++c) {
      double scale = 0.0;
      for (int64_t i = 0; i < p.tokens; ++i) {
        const double w = want[static_cast<std::size_t>(i * 4 + c)];
        if (std::isfinite(w)) scale = std::max(scale, std::fabs(w));
      }
      for (int64_t i = 0; i < p.tokens; ++i) {
        const double w = want[static_cast<std::size_t>(i * 4 + c)], g = got[static_cast<std::size_t>(i * 4 + c)];
        if (std::isfinite(w)) {
          EXPECT_NEAR(g, w, 1e-5 * scale) << "token " << i << " column " << c;
        } else {
          EXPECT_EQ(g, w) << "token " << i << " column " << c;
        }
      }
    }
  };
  return {"head local stats num_threads " + std::to_string(num_threads), call, check};
}

// row_max (widening bf16) and exp_rows_in_place with the row sums.
Case rows_case(int num_threads) {
  auto call = [=]() {
    Problem p = random_problem(19, 3000, kBFloat16, 53);
    std::vector<float> max(19), wide(19 * 3000), sums(19);
    const TensorView max_v = TensorView::contiguous(max.data(), kFloat32, {19});
    const TensorView wide_v = TensorView::contiguous(wide.data(), kFloat32, {19, 3000});
    const TensorView sums_v = TensorView::contiguous(sums.data(), kFloat32, {19});
    EXPECT_TRUE(row_max(p.shard_view({0, 3000, 3000}), max_v, &wide_v, num_threads).ok());
    EXPECT_TRUE(exp_rows_in_place(wide_v, max_v, &sums_v, num_threads).ok());
    Outputs out;
    append(out, max);
    append(out, wide);
    append(out, sums);
    return out;
  };
  auto check = [](const Outputs& got) {
    const Problem p = random_problem(19, 3000, kBFloat16, 53);
    for (int64_t i = 0; i < 19; ++i) {
      double max = -HUGE_VAL, sum = 0.0;
      for (int64_t v = 0; v < 3000; ++v) max = std::max(max, p.at(i, v));
      EXPECT_EQ(got[static_cast<std::size_t>(i)], max);
      for (int64_t v = 0; v < 3000; ++v) {
        const double e = std::exp(static_cast<double>(static_cast<float>(p.at(i, v) - max)));
        sum += e;
        EXPECT_NEAR(got[static_cast<std::size_t>(19 + i * 3000 + v)], e, 2e-7 * e);
      }
      EXPECT_NEAR(got[static_cast<std::size_t>(19 + 19 * 3000 + i)], sum, 1e-6 * sum);
    }
  };
  return {"rows num_threads " + std::to_string(num_threads), call, check};
}

std::vector<Case> every_case() {
  std::vector<Case> cases;
  for (int threads : {1, 2, 0}) {
    for (DataType dtype : {kFloat32, kBFloat16}) {
      cases.push_back(loss_case(dtype, false, false, threads));
      cases.push_back(loss_case(dtype, true, true, threads));
      cases.push_back(head_case(dtype, Mode::kRecompute, threads));
      cases.push_back(head_case(dtype, Mode::kChunked, threads));
    }
    cases.push_back(head_stats_case(threads));
    cases.push_back(rows_case(threads));
  }
  return cases;
}

class InsideOpenMpTeams : public testing::TestWithParam<bool> {};

TEST_P(InsideOpenMpTeams, EveryEntryGivesItsSerialResultOnEveryThreadOfTheTeam) {
  const bool nested = GetParam();
  const std::vector<Case> cases = every_case();
  std::vector<Outputs> serial;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    serial.push_back(c.run());
    c.check(serial.back());
  }
  const int levels = omp_get_max_active_levels();
  omp_set_max_active_levels(nested ? 2 : 1);
  for (int team : {1, 2, 4, 8}) {
    std::vector<int> wrong(cases.size(), 0);
#pragma omp parallel num_threads(team)
    {
      // Each thread takes the cases in its own order, so that different calls overlap.
      const int t = omp_get_thread_num();
      for (std::size_t k = 0; k < cases.size(); ++k) {
        const std::size_t c = (k + static_cast<std::size_t>(t) * 5) % cases.size();
        if (!same_bits(cases[c].run(), serial[c])) {
#pragma omp atomic
          ++wrong[c];
        }
      }
    }
    for (std::size_t c = 0; c < cases.size(); ++c) {
      EXPECT_EQ(wrong[c], 0) << cases[c].name << ": threads of a team of " << team << " whose outputs differ";
    }
  }
  omp_set_max_active_levels(levels);
}

INSTANTIATE_TEST_SUITE_P(Nesting, InsideOpenMpTeams, testing::Bool(), [](const testing::TestParamInfo<bool>& info) {
  return std::string(info.param ? "NestedOn" : "NestedOff");
});

}  // namespace
}  // namespace vpce::test
