// tests/cuda/cuda_rl_test.cc: the RL outputs (vpce/rl.h) on device tensors against the fp64
// oracle (reference::policy): R ranks as threads on one GPU (their gathers staged through the
// in-process backend), per-token temperatures in device memory, both upstream gradients,
// fp32 and bf16 logits, in place and out of place, ignored tokens, a soft cap with a scalar
// temperature, a bad temperature found on the device. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda_support.h"
#include "support.h"
#include "vpce/rl.h"

namespace vpce::test {
namespace {

struct DevicePolicyRun {
  std::vector<Status> status, device_status;
  std::vector<std::vector<float>> log_prob, entropy;
  std::vector<double> grad;  // [N, V]
};

std::vector<float> upstream(int64_t n, float scale, int salt) {
  std::vector<float> g(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[i] = scale * (static_cast<float>((i * 7 + salt) % 11) / 8.0f - 0.4f);
  return g;
}

DevicePolicyRun run_policy_on_device(Problem& problem, const std::vector<VocabShard>& shards,
                                     const rl::Options& options, const std::vector<float>& temperatures,
                                     bool in_place) {
  const int ranks = static_cast<int>(shards.size());
  const int64_t n = problem.tokens;
  RunOptions layout;
  layout.in_place = in_place;
  DeviceBuffer logits(problem.storage.data(), problem.storage.size());
  const DataType grad_dtype = in_place ? problem.dtype : kFloat32;
  DeviceBuffer grad(nullptr, static_cast<std::size_t>(n * problem.vocab * grad_dtype.bytes()));
  DeviceBuffer t(temperatures.data(), temperatures.size() * sizeof(float));
  const std::vector<float> g_lp = upstream(n, 1.0f, 1), g_h = upstream(n, 0.6f, 4);
  DeviceBuffer glp(g_lp.data(), g_lp.size() * sizeof(float)), gh(g_h.data(), g_h.size() * sizeof(float));
  DevicePolicyRun run;
  run.device_status.resize(static_cast<std::size_t>(ranks));
  run.log_prob.resize(static_cast<std::size_t>(ranks));
  run.entropy.resize(static_cast<std::size_t>(ranks));
  std::unique_ptr<ThreadGroup> group;
  EXPECT_TRUE(ThreadGroup::create(ranks, &group, std::chrono::seconds(20)).ok());
  run.status = group->run([&](Communicator& host) -> Status {
    const int r = host.rank();
    StagedDeviceComm staged(host);
    DeviceLoopback loopback;
    Communicator& comm = ranks == 1 ? static_cast<Communicator&>(loopback) : staged;
    DeviceBuffer y(problem.targets.data(), problem.targets.size() * sizeof(int64_t));
    DeviceBuffer lp(nullptr, n * sizeof(float) + 4), en(nullptr, n * sizeof(float) + 4);
    DeviceBuffer lse(nullptr, n * sizeof(double) + 8), mean(nullptr, n * sizeof(double) + 8);
    const VocabShard& shard = shards[static_cast<std::size_t>(r)];
    const int64_t cols = shard.vocab_end - shard.vocab_begin;
    const TensorView x = TensorView::matrix(
        static_cast<char*>(logits.p) + problem.offset_bytes + shard.vocab_begin * problem.dtype.bytes(), problem.dtype,
        n, cols, problem.ld, kGpu);
    const TensorView yv = TensorView::contiguous(y.p, kInt64, {n}, kGpu);
    const TensorView tv = TensorView::contiguous(t.p, kFloat32, {n}, kGpu);
    const TensorView lpv = TensorView::contiguous(lp.p, kFloat32, {n}, kGpu);
    const TensorView env = TensorView::contiguous(en.p, kFloat32, {n}, kGpu);
    const TensorView lsev = TensorView::contiguous(lse.p, kFloat64, {n}, kGpu);
    const TensorView meanv = TensorView::contiguous(mean.p, kFloat64, {n}, kGpu);
    const TensorView glpv = TensorView::contiguous(glp.p, kFloat32, {n}, kGpu);
    const TensorView ghv = TensorView::contiguous(gh.p, kFloat32, {n}, kGpu);
    cudaStream_t stream = nullptr;
    cudaStreamCreate(&stream);
    rl::Options opts = options;
    opts.stream = stream;
    std::optional<Workspace> holder(std::in_place);
    const TensorView* temps = temperatures.empty() ? nullptr : &tv;
    Status s = rl::forward(comm, x, yv, shard, opts, {&lpv, &env, &lsev, &meanv}, temps, &*holder);
    if (s.ok()) {
      const TensorView out =
          in_place ? x
                   : TensorView::matrix(static_cast<char*>(grad.p) + shard.vocab_begin * grad_dtype.bytes(), grad_dtype,
                                        n, cols, problem.vocab, kGpu);
      s = rl::backward(x, yv, lsev, &meanv, {&glpv, &ghv}, shard, opts, out, temps);
    }
    run.device_status[static_cast<std::size_t>(r)] = holder->device_status();
    cudaStreamSynchronize(stream);
    run.log_prob[static_cast<std::size_t>(r)] = lp.read<float>(static_cast<std::size_t>(n));
    run.entropy[static_cast<std::size_t>(r)] = en.read<float>(static_cast<std::size_t>(n));
    holder.reset();
    cudaStreamDestroy(stream);
    return s;
  });
  std::vector<std::byte> host(in_place ? 0 : grad.bytes);
  if (in_place) {
    cudaMemcpy(problem.storage.data(), logits.p, problem.storage.size(), cudaMemcpyDeviceToHost);
  } else {
    cudaMemcpy(host.data(), grad.p, grad.bytes, cudaMemcpyDeviceToHost);
  }
  run.grad = gathered_grad(problem, layout, host);
  return run;
}

reference::PolicyResult policy_oracle(const Problem& p, const rl::Options& options,
                                      const std::vector<float>& temperatures) {
  reference::Options o;
  o.ignore_index = options.ignore_index;
  o.logit_scale = options.logit_scale;
  o.softcap = options.softcap;
  o.valid_vocab = options.valid_vocab_size;
  std::vector<double> t = widen(temperatures);
  if (t.empty()) t.assign(static_cast<std::size_t>(p.tokens), static_cast<double>(options.temperature));
  return reference::policy(p.as_double(), p.tokens, p.vocab, p.targets, t, widen(upstream(p.tokens, 1.0f, 1)),
                           widen(upstream(p.tokens, 0.6f, 4)), o);
}

void expect_policy(const DevicePolicyRun& run, const reference::PolicyResult& want, double grad_tolerance) {
  for (std::size_t r = 0; r < run.status.size(); ++r) {
    ASSERT_TRUE(run.status[r].ok()) << run.status[r].to_string();
    ASSERT_TRUE(run.device_status[r].ok()) << run.device_status[r].to_string();
    EXPECT_EQ(run.log_prob[r], run.log_prob[0]) << "rank " << r;
    EXPECT_EQ(run.entropy[r], run.entropy[0]) << "rank " << r;
  }
  EXPECT_LT(relative_error(widen(run.log_prob[0]), want.log_prob), 1e-6);
  EXPECT_LT(relative_error(widen(run.entropy[0]), want.entropy), 1e-6);
  EXPECT_LT(relative_error(run.grad, want.grad), grad_tolerance);
}

std::vector<float> mixed_temperatures(int64_t n) {
  std::vector<float> t(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = i % 3 == 0 ? 0.5f : i % 3 == 1 ? 1.0f : 1.7f;
  return t;
}

TEST(CudaRl, MatchesTheOracleForRanksDtypesAndTemperatures) {
  REQUIRE_GPU();
  for (DataType dtype : {kFloat32, kBFloat16}) {
    for (int ranks : {1, 3}) {
      Problem p = random_problem(37, 1003, dtype, 70 + ranks);
      for (std::size_t i = 3; i < p.targets.size(); i += 7) p.targets[i] = -100;
      const std::vector<float> t = mixed_temperatures(p.tokens);
      const reference::PolicyResult want = policy_oracle(p, rl::Options{}, t);
      expect_policy(run_policy_on_device(p, shards_from_sizes(even_splits(1003, ranks)), rl::Options{}, t, false), want,
                    1e-5);
    }
  }
}

TEST(CudaRl, InPlaceSoftCapAndScalarTemperature) {
  REQUIRE_GPU();
  Problem p = random_problem(19, 700, kBFloat16, 5);
  rl::Options options;
  options.softcap = 5.0f;
  options.temperature = 0.8f;
  const reference::PolicyResult want = policy_oracle(p, options, {});
  expect_policy(run_policy_on_device(p, shards_from_sizes({400, 300}), options, {}, true), want, 4e-3);
}

TEST(CudaRl, ABadTemperatureIsFoundOnTheDeviceOnEveryRank) {
  REQUIRE_GPU();
  Problem p = random_problem(5, 200, kFloat32, 6);
  // -1, and 1e-40 (1 / T overflows fp32: every logit would be inf), each alone.
  for (const float bad : {-1.0f, 1e-40f}) {
    std::vector<float> t(5, 1.0f);
    t[2] = bad;
    const DevicePolicyRun run = run_policy_on_device(p, shards_from_sizes({100, 100}), rl::Options{}, t, false);
    for (const Status& s : run.device_status) {
      EXPECT_FALSE(s.ok()) << bad;
      EXPECT_NE(s.message().find("temperatures > 0 and >= "), std::string::npos) << s.message();
    }
  }
}

}  // namespace
}  // namespace vpce::test
