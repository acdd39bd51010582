// tests/reliability_test.cc: determinism across repeated runs, several in-process groups
// at once in one process, and one group reused for thousands of calls (leaks are caught by
// LeakSanitizer in scripts/sanitize.sh, races by ThreadSanitizer).
#include <gtest/gtest.h>

#include <atomic>
#include <new>
#include <thread>

#include "cpu/parallel.h"
#include "workspace.h"

#include "support.h"

namespace vpce::test {
namespace {

RunOptions busy_options() {
  RunOptions o;
  o.loss.label_smoothing = 0.1f;
  o.loss.z_loss_weight = 1e-3f;
  o.loss.softcap = 20.0f;
  o.loss.num_threads = 2;
  o.extras = true;
  return o;
}

void expect_identical(const RunResult& a, const RunResult& b) {
  for (const Status& s : a.status) ASSERT_TRUE(s.ok()) << s.to_string();
  for (const Status& s : b.status) ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(a.per_rank[0].loss, b.per_rank[0].loss);
  EXPECT_EQ(a.per_rank[0].lse, b.per_rank[0].lse);
  EXPECT_EQ(a.per_rank[0].entropy, b.per_rank[0].entropy);
  EXPECT_EQ(a.per_rank[0].target_is_argmax, b.per_rank[0].target_is_argmax);
  EXPECT_EQ(a.grad, b.grad);
}

TEST(Determinism, RepeatedRunsAreBitIdentical) {
  const Problem base = random_problem(40, 2000, kBFloat16, 12);
  const auto shards = shards_from_sizes(even_splits(2000, 3));
  Problem first_problem = base;
  const RunResult first = run_ranks(first_problem, shards, busy_options());
  for (int repeat = 0; repeat < 5; ++repeat) {
    Problem p = base;
    expect_identical(first, run_ranks(p, shards, busy_options()));
  }
}

// Two groups of 4 in-process ranks compute at the same time in one process; each gets
// exactly what it gets alone.
TEST(Concurrency, TwoGroupsAtOnce) {
  const Problem a = random_problem(30, 1500, kFloat32, 1), b = random_problem(25, 900, kFloat16, 2);
  const auto shards_a = shards_from_sizes(even_splits(1500, 4)), shards_b = shards_from_sizes({100, 500, 0, 300});
  Problem alone_a = a, alone_b = b;
  const RunResult expected_a = run_ranks(alone_a, shards_a, busy_options());
  const RunResult expected_b = run_ranks(alone_b, shards_b, busy_options());
  for (int round = 0; round < 5; ++round) {
    Problem pa = a, pb = b;
    RunResult got_a, got_b;
    std::thread first([&] { got_a = run_ranks(pa, shards_a, busy_options()); });
    std::thread second([&] { got_b = run_ranks(pb, shards_b, busy_options()); });
    first.join();
    second.join();
    expect_identical(expected_a, got_a);
    expect_identical(expected_b, got_b);
  }
}

// One group, one workspace per rank, thousands of forward + backward calls: the same
// answer every time, and the workspace stops growing after the first call.
TEST(Endurance, OneGroupThousandsOfCalls) {
  constexpr int64_t kTokens = 8, kVocab = 96;
  constexpr int kCalls = 3000;
  Problem problem = random_problem(kTokens, kVocab, kFloat32, 3);
  const auto shards = shards_from_sizes(even_splits(kVocab, 2));
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group).ok());
  std::vector<std::vector<float>> first_loss(2), first_grad(2);
  std::vector<int> mismatches(2, 0);
  std::vector<std::size_t> capacity_after_first(2), capacity_at_end(2);
  const auto results = group->run([&](Communicator& comm) -> Status {
    const auto r = static_cast<std::size_t>(comm.rank());
    const VocabShard& shard = shards[r];
    const int64_t cols = shard.vocab_end - shard.vocab_begin;
    const TensorView x = problem.shard_view(shard);
    const TensorView y = TensorView::contiguous(problem.targets.data(), kInt64, {kTokens});
    const TensorView g = TensorView::contiguous(problem.grad_loss.data(), kFloat32, {kTokens});
    std::vector<float> loss(kTokens), lse(kTokens), grad(static_cast<std::size_t>(kTokens * cols));
    const TensorView loss_view = TensorView::contiguous(loss.data(), kFloat32, {kTokens});
    const TensorView lse_view = TensorView::contiguous(lse.data(), kFloat32, {kTokens});
    const TensorView grad_view = TensorView::matrix(grad.data(), kFloat32, kTokens, cols, cols);
    LossOptions options;
    options.label_smoothing = 0.05f;
    options.num_threads = 1;
    Workspace workspace;
    for (int call = 0; call < kCalls; ++call) {
      if (Status s = forward(comm, x, y, shard, options, loss_view, lse_view, {}, &workspace); !s.ok()) return s;
      if (Status s = backward(x, y, lse_view, g, shard, options, grad_view); !s.ok()) return s;
      if (call == 0) {
        first_loss[r] = loss;
        first_grad[r] = grad;
        capacity_after_first[r] = workspace.capacity();
      } else if (loss != first_loss[r] || grad != first_grad[r]) {
        ++mismatches[r];
      }
    }
    capacity_at_end[r] = workspace.capacity();
    return {};
  });
  for (const Status& s : results) ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(mismatches, (std::vector<int>{0, 0}));
  EXPECT_EQ(capacity_at_end, capacity_after_first);
  EXPECT_EQ(first_loss[0], first_loss[1]);
}

// One rank over the whole vocabulary: fp32 logits x, int64 targets y, and its group.
struct OneRank {
  OneRank(int64_t tokens, int64_t vocab, uint64_t seed)
      : problem(random_problem(tokens, vocab, kFloat32, seed)),
        shard{0, vocab, vocab},
        x(problem.shard_view(shard)),
        y(TensorView::contiguous(problem.targets.data(), kInt64, {tokens})) {
    EXPECT_TRUE(ThreadGroup::create(1, &group).ok());
  }
  Problem problem;
  VocabShard shard;
  TensorView x, y;
  std::unique_ptr<ThreadGroup> group;
};

// A moved-from workspace is empty and serves as a new one (it crashed the forward), and the
// one it moved into keeps working: both give the loss a fresh workspace gives.
TEST(Workspace, MovedFromAndMovedIntoBothWork) {
  constexpr int64_t kTokens = 6;
  OneRank one(kTokens, 40, 5);
  ASSERT_NE(one.group, nullptr);
  const auto& [problem, shard, x, y, group] = one;
  auto loss_with = [&](Workspace* workspace) {
    std::vector<float> loss(kTokens, -1.0f), lse(kTokens);
    const Status s =
        forward(group->communicator(0), x, y, shard, {}, TensorView::contiguous(loss.data(), kFloat32, {kTokens}),
                TensorView::contiguous(lse.data(), kFloat32, {kTokens}), {}, workspace);
    EXPECT_TRUE(s.ok()) << s.to_string();
    return loss;
  };
  Workspace fresh;
  const std::vector<float> want = loss_with(&fresh);
  Workspace moved_into(std::move(fresh));
  EXPECT_EQ(fresh.capacity(), 0u);
  EXPECT_EQ(loss_with(&fresh), want);
  EXPECT_EQ(loss_with(&moved_into), want);
  Workspace assigned;
  assigned = std::move(moved_into);
  EXPECT_EQ(loss_with(&moved_into), want);
  EXPECT_EQ(loss_with(&assigned), want);
}

// One Workspace given to both ranks of a group: the second rank to take it finds the first's
// call holding it (that call waits in the gather for the second), so it is refused there by
// name and every rank returns the error, none waits; the workspace then serves again.
TEST(Workspace, GivenToTwoRanksAtOnceIsRefusedOnEveryRankAndNoneWaits) {
  constexpr int64_t kTokens = 5, kVocab = 60;
  Problem problem = random_problem(kTokens, kVocab, kFloat32, 6);
  const auto shards = shards_from_sizes(even_splits(kVocab, 2));
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group).ok());
  Workspace shared;
  std::vector<std::vector<float>> losses(2);
  auto run = [&](bool one_workspace) {
    std::vector<Workspace> own(2);
    return group->run([&](Communicator& comm) -> Status {
      const auto r = static_cast<std::size_t>(comm.rank());
      std::vector<float>& loss = losses[r];
      loss.assign(kTokens, -1.0f);
      std::vector<float> lse(kTokens);
      return forward(comm, problem.shard_view(shards[r]),
                     TensorView::contiguous(problem.targets.data(), kInt64, {kTokens}), shards[r], {},
                     TensorView::contiguous(loss.data(), kFloat32, {kTokens}),
                     TensorView::contiguous(lse.data(), kFloat32, {kTokens}), {}, one_workspace ? &shared : &own[r]);
    });
  };
  for (int round = 0; round < 3; ++round) {
    // (the last round's workspace moved from: both ranks find it without buffers, and one set
    // is made for it, which one rank holds)
    if (round == 2) Workspace elsewhere(std::move(shared));
    // (the rank refused: kInvalidArgument; the other: kRemoteError, with the same words)
    const std::vector<Status> refused = run(true);
    int invalid = 0;
    for (const Status& s : refused) {
      ASSERT_FALSE(s.ok());
      invalid += s.code() == Code::kInvalidArgument;
      EXPECT_TRUE(s.code() == Code::kInvalidArgument || s.code() == Code::kRemoteError) << s.to_string();
      EXPECT_NE(s.message().find("workspace: expected a Workspace no other call is using"), std::string::npos)
          << s.to_string();
    }
    EXPECT_EQ(invalid, 1);
    EXPECT_EQ(losses[0], std::vector<float>(kTokens, -1.0f));  // (nothing written)
  }
  for (const Status& s : run(false)) ASSERT_TRUE(s.ok()) << s.to_string();
  const std::vector<float> want = losses[0];
  EXPECT_EQ(losses[1], want);
  EXPECT_NE(want, std::vector<float>(kTokens, -1.0f));
}

// While a call holds a Workspace, another entry refuses it by name (the loss's and the RL
// outputs' forwards, device_status), writes nothing, and takes it again once the call ends.
TEST(Workspace, HeldByACallIsRefusedToAnotherCallUntilItEnds) {
  constexpr int64_t kTokens = 4;
  OneRank one(kTokens, 32, 7);
  ASSERT_NE(one.group, nullptr);
  const auto& [problem, shard, x, y, group] = one;
  Communicator& comm = group->communicator(0);
  std::vector<float> loss(kTokens, -1.0f), lse(kTokens), log_prob(kTokens, -1.0f);
  std::vector<double> lse64(kTokens);
  const TensorView loss_view = TensorView::contiguous(loss.data(), kFloat32, {kTokens});
  const TensorView lse_view = TensorView::contiguous(lse.data(), kFloat32, {kTokens});
  const TensorView log_prob_view = TensorView::contiguous(log_prob.data(), kFloat32, {kTokens});
  const TensorView lse64_view = TensorView::contiguous(lse64.data(), kFloat64, {kTokens});
  rl::Outputs outputs;
  outputs.log_prob = &log_prob_view;
  outputs.lse = &lse64_view;
  const std::string name = "workspace: expected a Workspace no other call is using";
  Workspace workspace;
  {
    detail::WorkspaceLease held(&workspace);  // (what a call on another thread holds)
    const Status loss_status = forward(comm, x, y, shard, {}, loss_view, lse_view, {}, &workspace);
    EXPECT_EQ(loss_status.code(), Code::kInvalidArgument);
    EXPECT_NE(loss_status.message().find(name), std::string::npos) << loss_status.to_string();
    const Status rl_status = rl::forward(comm, x, y, shard, {}, outputs, nullptr, &workspace);
    EXPECT_NE(rl_status.message().find(name), std::string::npos) << rl_status.to_string();
    const Status device = workspace.device_status();
    EXPECT_NE(device.message().find(name), std::string::npos) << device.to_string();
    EXPECT_EQ(loss, std::vector<float>(kTokens, -1.0f));
    EXPECT_EQ(log_prob, std::vector<float>(kTokens, -1.0f));
  }
  const Status loss_status = forward(comm, x, y, shard, {}, loss_view, lse_view, {}, &workspace);
  ASSERT_TRUE(loss_status.ok()) << loss_status.to_string();
  const Status rl_status = rl::forward(comm, x, y, shard, {}, outputs, nullptr, &workspace);
  ASSERT_TRUE(rl_status.ok()) << rl_status.to_string();
  EXPECT_TRUE(workspace.device_status().ok());
  for (int64_t t = 0; t < kTokens; ++t) EXPECT_FLOAT_EQ(log_prob[t], -loss[t]) << t;
}

// An allocation that fails on one of OpenMP's threads (the fused head's per-thread staging)
// reaches the caller as std::bad_alloc, which the library turns into an error; escaping the
// parallel region it would terminate the process. The other rows still run.
TEST(Threads, AnExceptionOnAWorkerThreadReachesTheCaller) {
  for (int threads : {1, 2, 4}) {
    std::atomic<int64_t> ran{0};
    bool caught = false;
    try {
      detail::parallel_rows(64, threads, [&](int64_t i) {
        ran.fetch_add(1);
        if (i == 63) throw std::bad_alloc();  // on the last thread's rows
      });
    } catch (const std::bad_alloc&) {
      caught = true;
    }
    EXPECT_TRUE(caught) << threads << " threads";
    EXPECT_EQ(ran.load(), 64) << threads << " threads";
  }
}

}  // namespace
}  // namespace vpce::test
