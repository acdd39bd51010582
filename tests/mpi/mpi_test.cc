// tests/mpi/mpi_test.cc: the MPI backend under mpirun (ctest runs it with 1 to 4 ranks, over
// shared memory and over TCP alone). Every rank also runs the same problem on the
// in-process backend and requires its MPI results to be bit-identical; the forward makes
// exactly one collective and the backward none (counted through the MPI profiling
// interface); ranks that disagree all return the same error; a rank that never arrives
// gives the others a timeout; tensor-parallel groups split out of the job work alone.
#include <gtest/gtest.h>

#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <functional>

#include "collective_counter.h"
#include "support.h"
#include "vpce/mpi.h"

namespace vpce::test {
namespace {

constexpr std::chrono::milliseconds kTestTimeout{std::chrono::seconds(60)};

int rank_of(MPI_Comm comm) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}
int size_of(MPI_Comm comm) {
  int s = 0;
  MPI_Comm_size(comm, &s);
  return s;
}

std::unique_ptr<MpiCommunicator> make_communicator(MPI_Comm comm, std::chrono::milliseconds timeout = kTestTimeout) {
  std::unique_ptr<MpiCommunicator> out;
  const Status s = MpiCommunicator::create(comm, &out, MpiOptions{timeout});
  EXPECT_TRUE(s.ok()) << s.to_string();
  return out;
}

// True when every rank of `comm` passes the same text.
bool same_on_every_rank(MPI_Comm comm, const std::string& text) {
  const uint64_t mine = std::hash<std::string>{}(text);
  std::vector<uint64_t> all(static_cast<std::size_t>(size_of(comm)));
  MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm);
  for (uint64_t h : all) {
    if (h != mine) return false;
  }
  return true;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Runs `problem` on the ranks of `group` through MPI and on as many in-process ranks, and
// requires this rank's outputs and gradient columns to be bit-identical.
void expect_matches_threads(MPI_Comm group, Problem problem, const std::vector<VocabShard>& shards,
                            const RunOptions& options) {
  const int r = rank_of(group);
  ASSERT_EQ(shards.size(), static_cast<std::size_t>(size_of(group)));
  Problem copy = problem;
  const RunResult expected = run_ranks(copy, shards, options);
  for (const Status& s : expected.status) ASSERT_TRUE(s.ok()) << s.to_string();

  std::unique_ptr<MpiCommunicator> comm = make_communicator(group);
  ASSERT_NE(comm, nullptr);
  RunResult mine = empty_result(size_of(group), problem.tokens, options.loss.reduction != Reduction::kNone);
  std::vector<std::byte> grad = grad_buffer(problem, options);
  RankOutputs& out = mine.per_rank[static_cast<std::size_t>(r)];
  const VocabShard& shard = shards[static_cast<std::size_t>(r)];
  const Status s = run_rank(*comm, problem, shard, options, &out, grad.data());
  ASSERT_TRUE(s.ok()) << s.to_string();

  const RankOutputs& want = expected.per_rank[static_cast<std::size_t>(r)];
  EXPECT_TRUE(bitwise_equal(out.loss, want.loss)) << "loss[0] " << out.loss[0] << " vs " << want.loss[0];
  EXPECT_TRUE(bitwise_equal(out.lse, want.lse));
  if (options.extras) {
    EXPECT_TRUE(bitwise_equal(out.target_is_argmax, want.target_is_argmax));
    EXPECT_TRUE(bitwise_equal(out.entropy, want.entropy));
  }
  const std::vector<double> g = gathered_grad(problem, options, grad);
  int64_t differing = 0;
  for (int64_t i = 0; i < problem.tokens; ++i) {
    for (int64_t v = shard.vocab_begin; v < shard.vocab_end; ++v) {
      const auto k = static_cast<std::size_t>(i * problem.vocab + v);
      differing += std::memcmp(&g[k], &expected.grad[k], sizeof(double)) != 0;
    }
  }
  EXPECT_EQ(differing, 0) << "gradient elements that differ from the in-process backend on rank " << r;
}

struct Case {
  const char* name;
  std::function<void(Problem&, RunOptions&)> setup;
};

std::vector<Case> cases() {
  return {
      {"plain", [](Problem&, RunOptions&) {}},
      {"smoothing, z-loss, weights, extras",
       [](Problem& p, RunOptions& o) {
         o.loss.label_smoothing = 0.1f;
         o.loss.z_loss_weight = 1e-3f;
         o.extras = true;
         for (int64_t i = 0; i < p.tokens; ++i) o.weights.push_back(i % 3 == 0 ? 0.0f : 0.5f + 0.25f * (i % 4));
       }},
      {"mean, pytorch smoothing, ignored tokens",
       [](Problem& p, RunOptions& o) {
         o.loss.reduction = Reduction::kMean;
         o.loss.smoothing_semantics = SmoothingSemantics::kPyTorch;
         o.loss.label_smoothing = 0.2f;
         o.grad_scalar = 0.75f;
         for (int64_t i = 0; i < p.tokens; i += 5) p.targets[static_cast<std::size_t>(i)] = -100;
       }},
      {"softcap, logit scale, padded vocabulary",
       [](Problem& p, RunOptions& o) {
         o.loss.softcap = 30.0f;
         o.loss.logit_scale = 0.5f;
         o.loss.valid_vocab_size = p.vocab - 5;
         for (int64_t& t : p.targets) t %= p.vocab - 5;
       }},
      {"staged API", [](Problem&, RunOptions& o) { o.staged = true; }},
  };
}

// Targets on both sides of every shard boundary.
void target_boundaries(Problem& p, const std::vector<VocabShard>& shards) {
  std::size_t i = 0;
  for (const VocabShard& s : shards) {
    if (s.vocab_end == s.vocab_begin) continue;
    if (i + 1 < p.targets.size()) {
      p.targets[i++] = s.vocab_begin;
      p.targets[i++] = s.vocab_end - 1;
    }
  }
}

TEST(Mpi, BitIdenticalToInProcessBackend) {
  const int ranks = size_of(MPI_COMM_WORLD);
  const std::vector<VocabShard> shards = shards_from_sizes(even_splits(203, ranks));
  for (DataType dtype : {kFloat32, kBFloat16, kFloat16}) {
    for (bool in_place : {false, true}) {
      for (const Case& c : cases()) {
        SCOPED_TRACE(std::string(c.name) + ", " + to_string(dtype) + (in_place ? ", in place" : ", out of place"));
        Problem p = random_problem(37, 203, dtype, 11);
        target_boundaries(p, shards);
        RunOptions o;
        o.in_place = in_place;
        c.setup(p, o);
        expect_matches_threads(MPI_COMM_WORLD, p, shards, o);
      }
    }
  }
}

TEST(Mpi, MatchesTheOracle) {
  // Bit-identity could hide a shared mistake: the fp32 results also meet the fp64 oracle.
  const int ranks = size_of(MPI_COMM_WORLD);
  const std::vector<VocabShard> shards = shards_from_sizes(even_splits(1000, ranks));
  Problem p = random_problem(64, 1000, kFloat32, 5);
  const RunOptions o;
  const reference::Result want = oracle(p, o);
  std::unique_ptr<MpiCommunicator> comm = make_communicator(MPI_COMM_WORLD);
  ASSERT_NE(comm, nullptr);
  RunResult mine = empty_result(ranks, p.tokens, false);
  std::vector<std::byte> grad = grad_buffer(p, o);
  const int r = rank_of(MPI_COMM_WORLD);
  ASSERT_TRUE(run_rank(*comm, p, shards[static_cast<std::size_t>(r)], o, &mine.per_rank[static_cast<std::size_t>(r)],
                       grad.data())
                  .ok());
  EXPECT_LT(relative_error(widen(mine.per_rank[static_cast<std::size_t>(r)].loss), want.loss), 1e-6);
  const std::vector<double> g = gathered_grad(p, o, grad);
  double worst = 0.0;
  const VocabShard& s = shards[static_cast<std::size_t>(r)];
  for (int64_t i = 0; i < p.tokens; ++i) {
    for (int64_t v = s.vocab_begin; v < s.vocab_end; ++v) {
      const auto k = static_cast<std::size_t>(i * p.vocab + v);
      worst = std::max(worst, std::fabs(g[k] - want.grad[k]));
    }
  }
  EXPECT_LT(worst, 1e-6);
}

TEST(Mpi, UnevenRangesWithAnEmptyShard) {
  const int ranks = size_of(MPI_COMM_WORLD);
  std::vector<int64_t> sizes(static_cast<std::size_t>(ranks), 0);
  // Rank 0 holds nothing (when there is another rank); the rest split 301 columns unevenly.
  const int first = ranks > 1 ? 1 : 0;
  int64_t left = 301;
  for (int r = first; r < ranks; ++r) {
    sizes[static_cast<std::size_t>(r)] = r == ranks - 1 ? left : 40 * r + 17;
    left -= sizes[static_cast<std::size_t>(r)];
  }
  const std::vector<VocabShard> shards = shards_from_sizes(sizes);
  for (DataType dtype : {kFloat32, kBFloat16}) {
    Problem p = random_problem(29, 301, dtype, 21);
    target_boundaries(p, shards);
    RunOptions o;
    o.loss.label_smoothing = 0.05f;
    expect_matches_threads(MPI_COMM_WORLD, p, shards, o);
  }
}

TEST(Mpi, AdversarialLogits) {
  // Large logits, -inf columns and a row that is all -inf but its target.
  const int ranks = size_of(MPI_COMM_WORLD);
  const std::vector<VocabShard> shards = shards_from_sizes(even_splits(157, ranks));
  Problem p = random_problem(23, 157, kFloat32, 8);
  for (int64_t v = 0; v < p.vocab; ++v) {
    p.set(0, v, v % 2 ? 1e4f : -1e4f);
    p.set(1, v, v == p.targets[1] ? 3.0f : -INFINITY);
    if (v % 7 == 0) p.set(2, v, -INFINITY);
  }
  if (p.targets[2] % 7 == 0) p.targets[2] += 1;
  expect_matches_threads(MPI_COMM_WORLD, p, shards, RunOptions{});
}

TEST(Mpi, OneCollectivePerForwardNoneInBackward) {
  const int ranks = size_of(MPI_COMM_WORLD);
  const int r = rank_of(MPI_COMM_WORLD);
  std::unique_ptr<MpiCommunicator> comm = make_communicator(MPI_COMM_WORLD);
  ASSERT_NE(comm, nullptr);
  const std::vector<VocabShard> shards = shards_from_sizes(even_splits(500, ranks));
  const VocabShard& shard = shards[static_cast<std::size_t>(r)];
  RunOptions o;
  // {tokens, collectives in the forward}: a first call that fits the first blocks is one
  // collective; one that outgrows them agrees the size first (two); then one again, also
  // when the payload shrinks.
  const std::pair<int64_t, int> calls[] = {{64, 1}, {1000, 2}, {1000, 1}, {1000, 1}, {999, 1}, {64, 1}, {1000, 2}};
  for (const auto& [tokens, collectives] : calls) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    Problem p = random_problem(tokens, 500, kFloat32, 3);
    RunResult mine = empty_result(ranks, tokens, false);
    RankOutputs& out = mine.per_rank[static_cast<std::size_t>(r)];
    const TensorView x = p.shard_view(shard);
    const TensorView y = TensorView::contiguous(p.targets.data(), kInt64, {tokens});
    const TensorView lse = TensorView::contiguous(out.lse.data(), kFloat64, {tokens});
    reset_mpi_call_counts();
    ASSERT_TRUE(
        forward(*comm, x, y, shard, o.loss, TensorView::contiguous(out.loss.data(), kFloat32, {tokens}), lse).ok());
    EXPECT_EQ(mpi_call_counts().collectives, collectives);
    EXPECT_EQ(mpi_call_counts().point_to_point, 0);
    reset_mpi_call_counts();
    const TensorView g = TensorView::contiguous(p.grad_loss.data(), kFloat32, {tokens});
    ASSERT_TRUE(backward(x, y, lse, g, shard, o.loss, x).ok());
    EXPECT_EQ(mpi_call_counts().collectives, 0);
    EXPECT_EQ(mpi_call_counts().point_to_point, 0);
  }
}

TEST(Mpi, TensorParallelGroupsSplitFromTheJob) {
  // Consecutive ranks in groups of two (as a 2-way tensor-parallel job with data
  // parallelism across groups), then every other rank (groups of non-adjacent ranks); each
  // group runs its own problem at the same time as the others.
  const int r = rank_of(MPI_COMM_WORLD);
  for (int layout = 0; layout < 2; ++layout) {
    const int color = layout == 0 ? r / 2 : r % 2;
    SCOPED_TRACE("layout " + std::to_string(layout) + ", group " + std::to_string(color));
    MPI_Comm group = MPI_COMM_NULL;
    ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, color, r, &group), MPI_SUCCESS);
    const std::vector<VocabShard> shards = shards_from_sizes(even_splits(211, size_of(group)));
    Problem p = random_problem(31, 211, kBFloat16, 100 + static_cast<uint64_t>(color));
    RunOptions o;
    o.loss.label_smoothing = 0.1f;
    expect_matches_threads(group, p, shards, o);
    MPI_Comm_free(&group);
  }
}

// Four-argument forward on rank-specific arguments, for the agreement tests: 6 tokens,
// V = 48 split evenly; `tweak` changes this rank's arguments. Returns the Status and
// checks that the outputs were not written on failure.
Status forward_with(MpiCommunicator& comm,
                    const std::function<void(int, int64_t&, VocabShard&, DataType&, LossOptions&)>& tweak,
                    bool* outputs_untouched) {
  const int ranks = comm.size();
  const int r = comm.rank();
  int64_t tokens = 6;
  VocabShard shard = shards_from_sizes(even_splits(48, ranks))[static_cast<std::size_t>(r)];
  DataType dtype = kFloat32;
  LossOptions options;
  tweak(r, tokens, shard, dtype, options);
  std::vector<float> logits(static_cast<std::size_t>(tokens * (shard.vocab_end - shard.vocab_begin)) + 1, 0.25f);
  std::vector<int64_t> targets(static_cast<std::size_t>(tokens), 7);
  std::vector<float> loss(static_cast<std::size_t>(tokens), -3.0f), lse(static_cast<std::size_t>(tokens), -3.0f);
  const Status s = forward(
      comm, TensorView::contiguous(logits.data(), dtype, {tokens, shard.vocab_end - shard.vocab_begin}),
      TensorView::contiguous(targets.data(), kInt64, {tokens}), shard, options,
      TensorView::contiguous(loss.data(), kFloat32, {tokens}), TensorView::contiguous(lse.data(), kFloat32, {tokens}));
  *outputs_untouched = true;
  for (std::size_t i = 0; i < loss.size(); ++i) *outputs_untouched &= loss[i] == -3.0f && lse[i] == -3.0f;
  return s;
}

// Every rank fails with the same message; the code is `code`, except that with
// `remote_elsewhere` only the rank at fault has it and the others kRemoteError.
void expect_every_rank_fails_alike(
    const std::function<void(int, int64_t&, VocabShard&, DataType&, LossOptions&)>& tweak, Code code,
    const std::string& words, int remote_elsewhere = -1) {
  if (size_of(MPI_COMM_WORLD) < 2) GTEST_SKIP() << "needs two ranks or more to disagree";
  std::unique_ptr<MpiCommunicator> comm = make_communicator(MPI_COMM_WORLD);
  ASSERT_NE(comm, nullptr);
  bool untouched = false;
  // Timed from a barrier: on an oversubscribed machine ranks reach the test seconds apart.
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  const Status s = forward_with(*comm, tweak, &untouched);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool remote = remote_elsewhere >= 0 && comm->rank() != remote_elsewhere;
  EXPECT_EQ(s.code(), remote ? Code::kRemoteError : code) << s.to_string();
  EXPECT_NE(s.message().find(words), std::string::npos) << s.to_string();
  EXPECT_TRUE(untouched);
  EXPECT_LT(seconds, 30.0);  // far from the communicator's 60 s timeout, on a loaded machine too
  EXPECT_TRUE(same_on_every_rank(MPI_COMM_WORLD, s.message())) << "rank " << comm->rank() << ": " << s.to_string();
  // The group is still usable: a call on which the ranks agree succeeds.
  const Status after = forward_with(
      *comm, [](int, int64_t&, VocabShard&, DataType&, LossOptions&) {}, &untouched);
  EXPECT_TRUE(after.ok()) << after.to_string();
}

TEST(MpiAgreement, DifferentVocabularyOnOneRank) {
  const int last = size_of(MPI_COMM_WORLD) - 1;
  expect_every_rank_fails_alike(
      [last](int r, int64_t&, VocabShard& shard, DataType&, LossOptions&) {
        if (r == last) {
          shard.vocab_size += 1;
          shard.vocab_end += 1;
        }
      },
      Code::kInvalidUsage, "vocabulary size");
}

TEST(MpiAgreement, DifferentDtypeOnOneRank) {
  const int last = size_of(MPI_COMM_WORLD) - 1;
  expect_every_rank_fails_alike(
      [last](int r, int64_t&, VocabShard&, DataType& dtype, LossOptions&) {
        if (r == last) dtype = kBFloat16;
      },
      Code::kInvalidUsage, "dtype");
}

TEST(MpiAgreement, DifferentTokenCountOnOneRank) {
  // The payload sizes differ: the backend's size agreement catches it.
  expect_every_rank_fails_alike(
      [](int r, int64_t& tokens, VocabShard&, DataType&, LossOptions&) {
        if (r == 0) tokens += 1;
      },
      Code::kInvalidUsage, "same number of bytes");
}

TEST(MpiAgreement, DifferentOptionsOnOneRank) {
  expect_every_rank_fails_alike(
      [](int r, int64_t&, VocabShard&, DataType&, LossOptions& options) {
        if (r == 1) options.label_smoothing = 0.1f;
      },
      Code::kInvalidUsage, "label_smoothing");
}

TEST(MpiAgreement, BadArgumentOnOneRank) {
  expect_every_rank_fails_alike(
      [](int r, int64_t&, VocabShard& shard, DataType&, LossOptions&) {
        if (r == 1) shard.vocab_begin = -1;
      },
      Code::kInvalidArgument, "rank 1 of", /*remote_elsewhere=*/1);
}

// all_gather called directly with rank-specific sizes or buffers: every rank gets `words`
// in the same message, and the group still works afterwards.
void expect_gather_fails_alike(const std::function<std::size_t(int)>& bytes_of, int null_rank, Code code,
                               const std::string& words) {
  if (size_of(MPI_COMM_WORLD) < 2) GTEST_SKIP() << "needs two ranks or more to disagree";
  std::unique_ptr<MpiCommunicator> comm = make_communicator(MPI_COMM_WORLD);
  ASSERT_NE(comm, nullptr);
  const int r = comm->rank();
  const std::size_t bytes = bytes_of(r);
  std::vector<std::byte> send(bytes), recv(bytes * static_cast<std::size_t>(comm->size()));
  const Status s = comm->all_gather(send.data(), r == null_rank ? nullptr : recv.data(), bytes);
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(words), std::string::npos) << s.to_string();
  EXPECT_TRUE(same_on_every_rank(MPI_COMM_WORLD, s.to_string())) << "rank " << r << ": " << s.to_string();
  std::vector<int32_t> one(1, r), all(static_cast<std::size_t>(comm->size()), -1);
  ASSERT_TRUE(comm->all_gather(one.data(), all.data(), sizeof(int32_t)).ok());
  for (int k = 0; k < comm->size(); ++k) EXPECT_EQ(all[static_cast<std::size_t>(k)], k);
}

TEST(MpiAgreement, SizeMismatchWhereOneRankMustGrow) {
  // Rank 0's payload outgrows the blocks, the others' fit: the header round catches it.
  expect_gather_fails_alike([](int r) { return r == 0 ? std::size_t{20000} : std::size_t{100}; }, -1,
                            Code::kInvalidUsage, "got 20000 from rank 0 and 100 from rank 1");
  // And the other way round: only the last rank outgrows them.
  const int last = size_of(MPI_COMM_WORLD) - 1;
  expect_gather_fails_alike([last](int r) { return r == last ? std::size_t{20000} : std::size_t{100}; }, -1,
                            Code::kInvalidUsage, "got 100 from rank 0 and 20000 from rank " + std::to_string(last));
}

TEST(MpiAgreement, NullBufferOnOneRank) {
  expect_gather_fails_alike([](int) { return std::size_t{64}; }, 1, Code::kInvalidArgument, "got a null one on rank 1");
}

TEST(MpiCreate, RanksWithDifferentTimeouts) {
  // Rank 0 waits forever, the others 20 s: the collectives still match (always non-blocking).
  const int r = rank_of(MPI_COMM_WORLD);
  std::unique_ptr<MpiCommunicator> comm =
      make_communicator(MPI_COMM_WORLD, r == 0 ? std::chrono::milliseconds(0) : std::chrono::milliseconds(20000));
  ASSERT_NE(comm, nullptr);
  std::vector<int32_t> one(1, r), all(static_cast<std::size_t>(comm->size()), -1);
  for (int call = 0; call < 3; ++call) {
    ASSERT_TRUE(comm->all_gather(one.data(), all.data(), sizeof(int32_t)).ok());
    for (int k = 0; k < comm->size(); ++k) EXPECT_EQ(all[static_cast<std::size_t>(k)], k);
  }
}

// CPU time of the calling thread (OpenMP's idle workers may spin in the process's time).
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

TEST(MpiFailure, RankThatNeverArrivesGivesTimeoutNotHang) {
  const int ranks = size_of(MPI_COMM_WORLD);
  if (ranks < 2) GTEST_SKIP() << "needs two ranks or more";
  const int r = rank_of(MPI_COMM_WORLD);
  const int straggler = ranks - 1;
  // Created with the long timeout (the ranks may reach this test seconds apart on a loaded
  // machine), then 1 s for the forward.
  std::unique_ptr<MpiCommunicator> comm = make_communicator(MPI_COMM_WORLD);
  ASSERT_NE(comm, nullptr);
  ASSERT_TRUE(comm->set_timeout(std::chrono::milliseconds(1000)).ok());
  EXPECT_EQ(comm->set_timeout(std::chrono::milliseconds(-5)).code(), Code::kInvalidArgument);
  // The straggler learns that the others are done through messages on a communicator of its
  // own, not by sleeping: on an oversubscribed machine a rank may reach the forward seconds
  // after another, so no sleep is long enough.
  MPI_Comm done_channel = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &done_channel), MPI_SUCCESS);
  bool untouched = false;
  const auto no_change = [](int, int64_t&, VocabShard&, DataType&, LossOptions&) {};
  if (r == straggler) {
    for (int other = 0; other < ranks; ++other) {
      if (other == straggler) continue;
      int done = 0;
      MPI_Recv(&done, 1, MPI_INT, other, 0, done_channel, MPI_STATUS_IGNORE);
    }
    // Joins the collective the others abandoned, so that it completes and frees nothing early.
    static_cast<void>(forward_with(*comm, no_change, &untouched));
  } else {
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = thread_cpu_seconds();
    const Status s = forward_with(*comm, no_change, &untouched);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // The wait sleeps once the straggler is late: it must not keep a core busy (it spun
    // at 100 % until the timeout).
    const double cpu = thread_cpu_seconds() - cpu_start;
    EXPECT_LT(cpu, 0.1 * seconds) << cpu << " s of CPU in " << seconds << " s";
    EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
    EXPECT_TRUE(untouched);
    EXPECT_GE(seconds, 0.9);
    EXPECT_LT(seconds, 30.0);  // the 1 s timeout, on a machine that may be oversubscribed
    // A broken communicator refuses at once: far sooner than a timeout of 60 s would end.
    ASSERT_TRUE(comm->set_timeout(std::chrono::milliseconds(60000)).ok());
    const auto again = std::chrono::steady_clock::now();
    const Status broken = forward_with(*comm, no_change, &untouched);
    EXPECT_EQ(broken.code(), Code::kInvalidUsage) << broken.to_string();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - again).count(), 30.0);
    int done = 1;
    MPI_Send(&done, 1, MPI_INT, straggler, 0, done_channel);
  }
  MPI_Comm_free(&done_channel);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiCreate, RejectsBadArguments) {
  std::unique_ptr<MpiCommunicator> comm;
  Status s = MpiCommunicator::create(MPI_COMM_NULL, &comm);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("MPI_COMM_NULL"), std::string::npos) << s.to_string();
  s = MpiCommunicator::create(MPI_COMM_WORLD, &comm, MpiOptions{std::chrono::milliseconds(-1)});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("options.timeout"), std::string::npos) << s.to_string();
  s = MpiCommunicator::create(MPI_COMM_WORLD, &comm, MpiOptions{std::chrono::hours(24 * 365)});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("options.timeout: expected 0 (none) to"), std::string::npos) << s.to_string();
  s = MpiCommunicator::create(MPI_COMM_WORLD, nullptr);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(comm, nullptr);
}

TEST(MpiCreate, NoTimeout) {
  // timeout 0 waits with MPI_Wait; results are the same.
  const int ranks = size_of(MPI_COMM_WORLD);
  std::unique_ptr<MpiCommunicator> comm = make_communicator(MPI_COMM_WORLD, std::chrono::milliseconds(0));
  ASSERT_NE(comm, nullptr);
  const int r = rank_of(MPI_COMM_WORLD);
  std::vector<int32_t> send(100, r), recv(static_cast<std::size_t>(100 * ranks), -1);
  ASSERT_TRUE(comm->all_gather(send.data(), recv.data(), send.size() * sizeof(int32_t)).ok());
  for (std::size_t i = 0; i < recv.size(); ++i) ASSERT_EQ(recv[i], static_cast<int32_t>(i / 100));
  ASSERT_TRUE(comm->all_gather(nullptr, nullptr, 0).ok());  // zero bytes is a valid (empty) gather
}

}  // namespace
}  // namespace vpce::test
