// tests/group_test.cc: the in-process backend and the forward's group protocol: exactly one
// collective per forward and none in backward; ranks that disagree (tokens, V, dtype,
// ranges, options, targets) or fail all return the same error; a rank that never arrives
// gives a timeout, not a hang.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>

#include "support.h"

namespace vpce::test {
namespace {

struct RankArgs {
  std::vector<float> logits;
  std::vector<int64_t> targets;
  VocabShard shard;
  DataType dtype = kFloat32;
  LossOptions options;
  std::vector<float> loss, lse;
};

// Four ranks over V = 40 with 5 tokens; `tweak(rank, args)` makes them disagree.
std::vector<Status> run_group(const std::function<void(int, RankArgs&)>& tweak, int ranks = 4) {
  std::unique_ptr<ThreadGroup> group;
  EXPECT_TRUE(ThreadGroup::create(ranks, &group, std::chrono::seconds(20)).ok());
  std::vector<RankArgs> args(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    RankArgs& a = args[static_cast<size_t>(r)];
    const int64_t width = 40 / ranks;
    a.shard = {r * width, (r + 1) * width, 40};
    a.targets = {0, 9, 10, 39, 20};
    tweak(r, a);
    a.logits.assign(a.targets.size() * static_cast<size_t>(a.shard.vocab_end - a.shard.vocab_begin), 0.5f);
    a.loss.assign(5, -7.0f);
    a.lse.assign(5, -7.0f);
  }
  return group->run([&](Communicator& comm) {
    RankArgs& a = args[static_cast<size_t>(comm.rank())];
    const int64_t cols = a.shard.vocab_end - a.shard.vocab_begin;
    const Status s =
        forward(comm, TensorView::contiguous(a.logits.data(), a.dtype, {static_cast<int64_t>(a.targets.size()), cols}),
                TensorView::contiguous(a.targets.data(), kInt64, {static_cast<int64_t>(a.targets.size())}), a.shard,
                a.options, TensorView::contiguous(a.loss.data(), kFloat32, {static_cast<int64_t>(a.targets.size())}),
                TensorView::contiguous(a.lse.data(), kFloat32, {static_cast<int64_t>(a.targets.size())}));
    if (!s.ok()) {
      for (float v : a.loss) EXPECT_EQ(v, -7.0f) << "loss written despite the error";
    }
    return s;
  });
}

// Every rank fails; all messages are the same and contain every fragment.
void expect_all_fail(const std::vector<Status>& results, std::initializer_list<const char*> fragments) {
  for (std::size_t r = 0; r < results.size(); ++r) {
    EXPECT_FALSE(results[r].ok()) << "rank " << r << " succeeded";
    EXPECT_EQ(results[r].message(), results[0].message()) << "rank " << r;
    for (const char* f : fragments) {
      EXPECT_NE(results[r].message().find(f), std::string::npos) << "missing '" << f << "' in " << results[r].message();
    }
  }
}

TEST(Group, AgreeingRanksSucceed) {
  for (const Status& s : run_group([](int, RankArgs&) {})) EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST(Group, OneCollectivePerForwardNonePerBackward) {
  Problem problem = random_problem(9, 100, kFloat32, 1);
  const auto shards = shards_from_sizes(even_splits(100, 3));
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(3, &group).ok());
  std::vector<int> calls(3);
  const auto results = group->run([&](Communicator& comm) -> Status {
    CountingCommunicator counting(comm);
    const auto& shard = shards[static_cast<size_t>(comm.rank())];
    std::vector<float> loss(9), lse(9), grad(9 * 100);
    const TensorView x = problem.shard_view(shard);
    const TensorView y = TensorView::contiguous(problem.targets.data(), kInt64, {9});
    for (int step = 0; step < 5; ++step) {
      if (Status s = forward(counting, x, y, shard, LossOptions{}, TensorView::contiguous(loss.data(), kFloat32, {9}),
                             TensorView::contiguous(lse.data(), kFloat32, {9}));
          !s.ok()) {
        return s;
      }
      if (Status s = backward(x, y, TensorView::contiguous(lse.data(), kFloat32, {9}),
                              TensorView::contiguous(problem.grad_loss.data(), kFloat32, {9}), shard, LossOptions{},
                              TensorView::matrix(grad.data(), kFloat32, 9, shard.vocab_end - shard.vocab_begin, 100));
          !s.ok()) {
        return s;
      }
    }
    calls[static_cast<size_t>(comm.rank())] = counting.calls;
    return {};
  });
  for (const Status& s : results) ASSERT_TRUE(s.ok()) << s.to_string();
  for (int c : calls) EXPECT_EQ(c, 5) << "5 forwards and 5 backwards must make exactly 5 collectives";
}

TEST(Group, OverlappingRanges) {
  expect_all_fail(run_group([](int r, RankArgs& a) {
                    if (r == 1) a.shard = {8, 20, 40};
                  }),
                  {"vocabulary ranges do not partition [0, 40)", "rank 0 [0, 10) and rank 1 [8, 20) overlap"});
}

TEST(Group, GapInRanges) {
  expect_all_fail(run_group([](int r, RankArgs& a) {
                    if (r == 3) a.shard = {32, 40, 40};
                  }),
                  {"vocabulary ranges do not partition", "[30, 32) owned by no rank"});
}

TEST(Group, GapAtTheEndOfTheVocabulary) {
  expect_all_fail(run_group([](int r, RankArgs& a) {
                    if (r == 3) a.shard = {30, 38, 40};
                  }),
                  {"vocabulary ranges do not partition [0, 40)", "columns [38, 40) owned by no rank"});
}

TEST(Group, DifferentVocabularySize) {
  expect_all_fail(run_group([](int r, RankArgs& a) {
                    if (r == 2) a.shard.vocab_size = 41;
                  }),
                  {"ranks disagree on the vocabulary size", "expected rank 0's 40 on every rank", "got 41 on rank 2"});
}

TEST(Group, DifferentDtype) {
  expect_all_fail(run_group([](int r, RankArgs& a) {
                    if (r == 1) a.dtype = kBFloat16;
                  }),
                  {"ranks disagree on the logits' dtype", "float32", "bfloat16"});
}

TEST(Group, DifferentLabelSmoothing) {
  expect_all_fail(run_group([](int r, RankArgs& a) {
                    if (r == 3) a.options.label_smoothing = 0.1f;
                  }),
                  {"ranks disagree on options.label_smoothing"});
}

// Values one ulp apart print differently, so the message shows the difference.
TEST(Group, OptionsOneUlpApartPrintDifferently) {
  expect_all_fail(
      run_group([](int r, RankArgs& a) { a.options.label_smoothing = r == 1 ? std::nextafter(0.1f, 1.0f) : 0.1f; }),
      {"ranks disagree on options.label_smoothing", "expected rank 0's 0.1 on every rank", "got 0.10000001 on rank 1"});
}

// -0 is 0: a rank that spells an option (z-loss, smoothing, soft-cap) as -0
// agrees with the others (they failed with "expected rank 0's 0, got -0").
TEST(Group, AnOptionOfMinusZeroAgreesWithZero) {
  for (const Status& s : run_group([](int r, RankArgs&a) {
         if (r % 2 == 1) {
           a.options.z_loss_weight = -0.0f;
           a.options.label_smoothing = -0.0f;
           a.options.softcap = -0.0f;
         }
       })) {
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
}

TEST(Group, DifferentTargets) {
  expect_all_fail(run_group([](int r, RankArgs& a) {
                    if (r == 2) a.targets[1] = 8;
                  }),
                  {"ranks disagree on the targets, weights or temperatures"});
}

// Targets {0, 0} on one rank and {1, D} on the other, D (the ignore_index) chosen so that the
// FNV-1a over 64-bit words used before gave both the same hash: told, as any difference.
TEST(Group, TargetsMadeToCollideUnderTheOldHashAreTold) {
  const uint64_t prime = 0x100000001b3ULL, basis = 0xcbf29ce484222325ULL;
  const auto d = static_cast<int64_t>(((basis ^ 0) * prime) ^ ((basis ^ 1) * prime));
  std::vector<float> x = {1, 2, 3, 4, 4, 3, 2, 1};
  const std::vector<std::vector<int64_t>> y = {{0, 0}, {1, d}};
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group, std::chrono::seconds(20)).ok());
  std::vector<float> loss(2, -7.0f), lse(4);
  const std::vector<Status> results = group->run([&](Communicator& comm) {
    const int r = comm.rank();
    LossOptions options;
    options.ignore_index = d;
    options.reduction = Reduction::kSum;
    return forward(comm, TensorView::matrix(x.data() + 2 * r, kFloat32, 2, 2, 4),
                   TensorView::contiguous(y[static_cast<std::size_t>(r)].data(), kInt64, {2}), {2 * r, 2 * r + 2, 4},
                   options, TensorView::contiguous(&loss[static_cast<std::size_t>(r)], kFloat32, {1}),
                   TensorView::contiguous(lse.data() + 2 * r, kFloat32, {2}));
  });
  expect_all_fail(results, {"ranks disagree on the targets, weights or temperatures"});
  EXPECT_EQ(loss, (std::vector<float>{-7.0f, -7.0f}));
}

TEST(Group, DifferentNumberOfTokens) {
  expect_all_fail(run_group([](int r, RankArgs& a) {
                    if (r == 1) a.targets.push_back(3);
                  }),
                  {"ranks disagree on the all_gather size",
                   "(a vpce call gathers a size set by its number of tokens (in the fused head's chunked mode, by its "
                   "chunk: head.chunk_tokens and head.token_block), the outputs it was asked for"});
}

TEST(Group, OneRankWithBadArgumentsFailsEveryRank) {
  const auto results = run_group([](int r, RankArgs& a) {
    if (r == 2) a.targets[0] = 40;
  });
  expect_all_fail(results, {"rank 2 of 4", "targets", "got 40 at token 0"});
  EXPECT_EQ(results[2].code(), Code::kInvalidArgument);
  EXPECT_EQ(results[0].code(), Code::kRemoteError);
}

#ifndef VPCE_SANITIZED_ADDRESS_SPACE  // a sanitizer's shadow memory needs an unlimited address space
// A group whose threads cannot all be started (4096 ranks' stacks in a 1 GiB address space,
// in a child process): no rank runs, every rank gets kSystemError saying how many started,
// at once, not after the group's timeout of 100 s (ranks once waited for it at their first
// collective).
TEST(Group, ThreadsThatCannotStartFailEveryRankAtOnce) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(60);  // a hang fails the test instead of blocking it
    const rlimit limit{1u << 30, 1u << 30};
    if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(3);
    std::unique_ptr<ThreadGroup> group;
    if (!ThreadGroup::create(4096, &group, std::chrono::seconds(100)).ok()) _exit(4);
    std::atomic<int> ran{0};
    const auto start = std::chrono::steady_clock::now();
    const std::vector<Status> results = group->run([&](Communicator& comm) {
      ++ran;
      char byte = 0, all[4096];
      return comm.all_gather(&byte, all, 1);
    });
    const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (const Status& s : results) {
      if (s.code() != Code::kSystemError || s.message().rfind(ThreadGroup::kCouldNotStart, 0) != 0 ||
          s.message().find("expected 4096 rank threads, could start only") == std::string::npos) {
        _exit(5);
      }
    }
    _exit(ran == 0 && seconds < 20.0 ? 0 : 6);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed (signal " << WTERMSIG(status) << "): it hung or crashed";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: setrlimit, 4: create, 5: a rank's status, 6: a rank ran or it took >= 20 s";
}
#endif

TEST(Group, MissingRankTimesOutAndBreaksTheGroup) {
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group, std::chrono::milliseconds(200)).ok());
  std::vector<float> send(4, 1.0f), recv(8);
  const auto results = group->run([&](Communicator& comm) -> Status {
    if (comm.rank() == 1) return {};  // never arrives
    return comm.all_gather(send.data(), recv.data(), sizeof(float) * 4);
  });
  EXPECT_EQ(results[0].code(), Code::kTimeout) << results[0].to_string();
  const auto again = group->run([&](Communicator& comm) { return comm.all_gather(send.data(), recv.data(), 16); });
  for (const Status& s : again) {
    EXPECT_EQ(s.code(), Code::kInvalidUsage);
    EXPECT_NE(s.message().find("broken"), std::string::npos) << s.message();
  }
}

TEST(Group, AllGatherOrdersByRank) {
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(5, &group).ok());
  std::vector<std::vector<int>> received(5, std::vector<int>(10));
  const auto results = group->run([&](Communicator& comm) {
    const int mine[2] = {comm.rank(), comm.rank() * 10};
    return comm.all_gather(mine, received[static_cast<size_t>(comm.rank())].data(), sizeof(mine));
  });
  for (const Status& s : results) ASSERT_TRUE(s.ok());
  for (const auto& got : received) EXPECT_EQ(got, (std::vector<int>{0, 0, 1, 10, 2, 20, 3, 30, 4, 40}));
}

// The backend's preconditions, checked on every rank alike (no rank left waiting for the
// timeout): send and recv that overlap (rank 1's send inside its recv: rank 0's bytes were
// copied over it before rank 1's were read, with success), one rank's recv that another's
// send or recv overlaps, one rank alone gathering in place, and a null buffer on one rank.
TEST(Group, AllGatherRefusesOverlappingOrNullBuffersOnEveryRank) {
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group, std::chrono::seconds(20)).ok());
  std::vector<std::vector<int>> buffers(2, std::vector<int>(6, 0));
  for (int variant = 0; variant < 2; ++variant) {
    const auto results = group->run([&](Communicator& comm) {
      const int r = comm.rank();
      int* mine = buffers[static_cast<size_t>(r)].data();
      for (int k = 0; k < 6; ++k) mine[k] = 10 * r + k;
      int other[2] = {r, r};
      if (r == 1) return comm.all_gather(variant == 0 ? mine + 1 : nullptr, mine, 2 * sizeof(int));
      return comm.all_gather(other, mine, 2 * sizeof(int));
    });
    const char* want = variant == 0 ? "all_gather: rank 1 of 2: expected send and recv buffers that do not overlap"
                                    : "all_gather: rank 1 of 2: expected non-null send and recv buffers";
    EXPECT_EQ(results[0].code(), Code::kRemoteError) << results[0].message();
    EXPECT_EQ(results[1].code(), Code::kInvalidArgument) << results[1].message();
    for (const Status& s : results) EXPECT_NE(s.message().find(want), std::string::npos) << s.message();
  }
  // Rank 1 sends from inside rank 0's recv buffer, or gathers into it: rank 0's copy would
  // overwrite what rank 1 sends or receives. Every rank fails alike.
  std::vector<int> shared_buffer(8, 0);
  for (int variant = 0; variant < 2; ++variant) {
    const auto results = group->run([&](Communicator& comm) {
      int mine[2] = {comm.rank(), comm.rank()};
      std::vector<int> own(4);
      if (comm.rank() == 0) return comm.all_gather(mine, shared_buffer.data(), 2 * sizeof(int));
      if (variant == 0) return comm.all_gather(shared_buffer.data() + 1, own.data(), 2 * sizeof(int));
      return comm.all_gather(mine, shared_buffer.data() + 2, 2 * sizeof(int));
    });
    for (const Status& s : results) {
      EXPECT_EQ(s.code(), Code::kInvalidUsage) << s.message();
      EXPECT_NE(
          s.message().find(std::string("got rank 0's recv overlapping rank 1's ") + (variant == 0 ? "send" : "recv")),
          std::string::npos)
          << s.message();
    }
  }
  std::unique_ptr<ThreadGroup> alone;
  ASSERT_TRUE(ThreadGroup::create(1, &alone).ok());
  int value[1] = {7};
  const Status s = alone->communicator(0).all_gather(value, value, sizeof(value));
  EXPECT_NE(s.message().find("do not overlap"), std::string::npos) << s.message();
  // The group still works afterwards.
  const auto fine = group->run([&](Communicator& comm) {
    int mine[1] = {comm.rank()};
    int all[2] = {};
    return comm.all_gather(mine, all, sizeof(mine));
  });
  for (const Status& st : fine) EXPECT_TRUE(st.ok()) << st.message();
}

TEST(Group, ExceptionInRankFunctionBecomesAnError) {
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  const auto results = group->run([](Communicator&) -> Status { throw std::runtime_error("boom"); });
  EXPECT_EQ(results[0].code(), Code::kInternalError);
  EXPECT_NE(results[0].message().find("boom"), std::string::npos);
}

TEST(Group, EmptyRangeInsideAnotherRankRangeIsFine) {
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group).ok());
  std::vector<float> logits(3 * 8, 0.0f), loss0(3), lse0(3), loss1(3), lse1(3);
  std::vector<int64_t> targets = {0, 4, 7};
  const auto results = group->run([&](Communicator& comm) {
    const bool first = comm.rank() == 0;
    const VocabShard shard = first ? VocabShard{0, 8, 8} : VocabShard{4, 4, 8};
    return forward(comm, TensorView::contiguous(logits.data(), kFloat32, {3, first ? 8 : 0}),
                   TensorView::contiguous(targets.data(), kInt64, {3}), shard, LossOptions{},
                   TensorView::contiguous(first ? loss0.data() : loss1.data(), kFloat32, {3}),
                   TensorView::contiguous(first ? lse0.data() : lse1.data(), kFloat32, {3}));
  });
  for (const Status& s : results) ASSERT_TRUE(s.ok()) << s.to_string();
  for (float l : loss1) EXPECT_NEAR(l, std::log(8.0f), 1e-6f);
  EXPECT_EQ(loss0, loss1);
}

// A rank whose targets view claims 2^40 tokens neither allocates for them nor leaves the
// other rank waiting: both return an error long before the group's timeout.
TEST(Group, AbsurdTargetsViewFailsFastOnEveryRank) {
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(2, &group, std::chrono::seconds(30)).ok());
  std::vector<float> logits(4 * 5, 0.0f), loss(8), lse(8);
  std::vector<int64_t> targets = {0, 1, 2, 3};
  const auto start = std::chrono::steady_clock::now();
  const auto results = group->run([&](Communicator& comm) {
    const int r = comm.rank();
    const TensorView y = r == 1 ? TensorView::contiguous(targets.data(), kInt64, {int64_t{1} << 40})
                                : TensorView::contiguous(targets.data(), kInt64, {4});
    return forward(comm, TensorView::matrix(logits.data() + 2 * r, kFloat32, 4, r == 0 ? 2 : 3, 5), y,
                   r == 0 ? VocabShard{0, 2, 5} : VocabShard{2, 5, 5}, LossOptions{},
                   TensorView::contiguous(loss.data() + 4 * r, kFloat32, {4}),
                   TensorView::contiguous(lse.data() + 4 * r, kFloat32, {4}));
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0);
  EXPECT_EQ(results[1].code(), Code::kInvalidArgument) << results[1].to_string();
  EXPECT_NE(results[1].message().find("targets.shape"), std::string::npos) << results[1].message();
  EXPECT_FALSE(results[0].ok());
}

}  // namespace
}  // namespace vpce::test
