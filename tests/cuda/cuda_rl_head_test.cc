// tests/cuda/cuda_rl_head_test.cc: the RL outputs in the fused head on device tensors
// (rl::linear_forward / linear_backward, the recompute mode, and linear_forward_backward, the
// chunked mode) against the same calls on the CPU, which tests/rl/rl_head_test.cc holds to the
// fp64 oracle: R 1 and 2 ranks as threads on one GPU with uneven ranges, per-token
// temperatures in device memory, both upstream gradients, fp32 operands with a bias, small
// tiles and chunks, ignored tokens; a bad temperature found on the device; sum_p_squared
// refused by name. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda_support.h"
#include "support.h"
#include "vpce/rl.h"

namespace vpce::test {
namespace {

struct PolicyHeadProblem {
  int64_t n = 0, h = 0, v = 0;
  std::vector<float> hidden, weight, bias, temperatures, g_lp, g_h;
  std::vector<int64_t> targets;
};

PolicyHeadProblem policy_head_problem(int64_t n, int64_t h, int64_t v, uint64_t seed) {
  PolicyHeadProblem p{n, h, v};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t k = 0; k < n * h; ++k) p.hidden.push_back(normal(rng));
  for (int64_t k = 0; k < v * h; ++k) p.weight.push_back(normal(rng) * 3.0f / std::sqrt(static_cast<float>(h)));
  for (int64_t k = 0; k < v; ++k) p.bias.push_back(normal(rng));
  for (int64_t i = 0; i < n; ++i) {
    p.targets.push_back(i % 7 == 3 ? -100 : static_cast<int64_t>(rng() % static_cast<uint64_t>(v)));
    p.temperatures.push_back(i % 3 == 0 ? 0.5f : i % 3 == 1 ? 1.0f : 1.7f);
    p.g_lp.push_back(static_cast<float>((i * 5 + 1) % 9) / 6.0f - 0.4f);
    p.g_h.push_back(0.5f * (static_cast<float>((i * 5 + 3) % 9) / 6.0f - 0.4f));
  }
  return p;
}

// Per rank: log_prob, entropy; the gradients summed over ranks (hidden) or laid out over the
// vocabulary (weight, bias); the device's status.
struct PolicyHeadRun {
  std::vector<Status> status, device_status;
  std::vector<std::vector<float>> log_prob, entropy;
  std::vector<double> grad_hidden, grad_weight, grad_bias;
};

HeadOptions small_tiles() {
  HeadOptions head;
  head.token_block = 8;
  head.vocab_block = 64;
  head.chunk_tokens = 16;  // (the chunked mode)
  return head;
}

// The recompute mode, or the chunked one, on the device (on_device) or on the CPU, R ranks as
// threads.
PolicyHeadRun run_policy_head(const PolicyHeadProblem& p, const std::vector<int64_t>& sizes, bool on_device,
                              bool chunked = false) {
  const int ranks = static_cast<int>(sizes.size());
  const std::vector<VocabShard> shards = shards_from_sizes(sizes);
  const Device device = on_device ? kGpu : Device{};
  auto place = [&](const void* host, std::size_t bytes) {
    return on_device ? std::make_unique<DeviceBuffer>(host, bytes) : nullptr;
  };
  // Device copies of the inputs (host memory is read directly on the CPU).
  const auto hidden = place(p.hidden.data(), p.hidden.size() * sizeof(float));
  const auto weight = place(p.weight.data(), p.weight.size() * sizeof(float));
  const auto bias = place(p.bias.data(), p.bias.size() * sizeof(float));
  const auto targets = place(p.targets.data(), p.targets.size() * sizeof(int64_t));
  const auto temps = place(p.temperatures.data(), p.temperatures.size() * sizeof(float));
  const auto g_lp = place(p.g_lp.data(), p.g_lp.size() * sizeof(float));
  const auto g_h = place(p.g_h.data(), p.g_h.size() * sizeof(float));
  auto at = [&](const std::unique_ptr<DeviceBuffer>& d, const void* host) {
    return d != nullptr ? d->p : const_cast<void*>(host);
  };
  PolicyHeadRun run;
  run.log_prob.assign(static_cast<std::size_t>(ranks), {});
  run.entropy = run.log_prob;
  run.device_status.resize(static_cast<std::size_t>(ranks));
  std::vector<std::vector<float>> dh(static_cast<std::size_t>(ranks)), dw(static_cast<std::size_t>(ranks)),
      db(static_cast<std::size_t>(ranks));
  std::unique_ptr<ThreadGroup> group;
  EXPECT_TRUE(ThreadGroup::create(ranks, &group, std::chrono::seconds(20)).ok());
  run.status = group->run([&](Communicator& host) -> Status {
    const int r = host.rank();
    const VocabShard& shard = shards[static_cast<std::size_t>(r)];
    const int64_t rows = shard.vocab_end - shard.vocab_begin;
    StagedDeviceComm staged(host);
    DeviceLoopback loopback;
    Communicator& comm = !on_device ? host : ranks == 1 ? static_cast<Communicator&>(loopback) : staged;
    std::vector<float> lp(static_cast<std::size_t>(p.n)), en(lp), gh_host(static_cast<std::size_t>(p.n * p.h)),
        gw_host(static_cast<std::size_t>(rows * p.h)), gb_host(static_cast<std::size_t>(rows));
    std::vector<double> lse(static_cast<std::size_t>(p.n)), mean(lse);
    const auto lp_d = place(nullptr, lp.size() * sizeof(float)), en_d = place(nullptr, en.size() * sizeof(float));
    const auto lse_d = place(nullptr, lse.size() * sizeof(double)),
               mean_d = place(nullptr, mean.size() * sizeof(double));
    const auto gh_d = place(nullptr, gh_host.size() * sizeof(float)),
               gw_d = place(nullptr, gw_host.size() * sizeof(float));
    const auto gb_d = place(nullptr, gb_host.size() * sizeof(float));
    auto vec = [&](void* base, DataType dtype) { return TensorView::contiguous(base, dtype, {p.n}, device); };
    const TensorView w =
        TensorView::matrix(static_cast<char*>(at(weight, p.weight.data())) + shard.vocab_begin * p.h * 4, kFloat32,
                           rows, p.h, p.h, device);
    const TensorView b = TensorView::contiguous(static_cast<char*>(at(bias, p.bias.data())) + shard.vocab_begin * 4,
                                                kFloat32, {rows}, device);
    const HeadInputs inputs{TensorView::matrix(at(hidden, p.hidden.data()), kFloat32, p.n, p.h, p.h, device), w, &b};
    const TensorView y = vec(at(targets, p.targets.data()), kInt64);
    const TensorView t = vec(at(temps, p.temperatures.data()), kFloat32);
    const TensorView lpv = vec(at(lp_d, lp.data()), kFloat32), env = vec(at(en_d, en.data()), kFloat32);
    const TensorView lsev = vec(at(lse_d, lse.data()), kFloat64), meanv = vec(at(mean_d, mean.data()), kFloat64);
    const TensorView glpv = vec(at(g_lp, p.g_lp.data()), kFloat32), ghv = vec(at(g_h, p.g_h.data()), kFloat32);
    const TensorView dhv = TensorView::matrix(at(gh_d, gh_host.data()), kFloat32, p.n, p.h, p.h, device);
    const TensorView dwv = TensorView::matrix(at(gw_d, gw_host.data()), kFloat32, rows, p.h, p.h, device);
    const TensorView dbv = TensorView::contiguous(at(gb_d, gb_host.data()), kFloat32, {rows}, device);
    cudaStream_t stream = nullptr;
    if (on_device) cudaStreamCreate(&stream);
    rl::Options options;
    options.stream = stream;
    std::optional<Workspace> workspace(std::in_place);
    const HeadGradients grads{{&dhv, false}, {&dwv, false}, {&dbv, false}};
    Status s = chunked ? rl::linear_forward_backward(comm, inputs, y, shard, options, small_tiles(), {&glpv, &ghv},
                                                     {&lpv, &env, &lsev, &meanv}, grads, &t, &*workspace)
                       : rl::linear_forward(comm, inputs, y, shard, options, small_tiles(), {&lpv, &env, &lsev, &meanv},
                                            &t, &*workspace);
    if (s.ok() && !chunked) {
      s = rl::linear_backward(inputs, y, lsev, &meanv, {&glpv, &ghv}, shard, options, small_tiles(), grads, &t,
                              &*workspace);
    }
    run.device_status[static_cast<std::size_t>(r)] = workspace->device_status();
    if (on_device) {
      cudaStreamSynchronize(stream);
      lp = lp_d->read<float>(lp.size());
      en = en_d->read<float>(en.size());
      gh_host = gh_d->read<float>(gh_host.size());
      gw_host = gw_d->read<float>(gw_host.size());
      gb_host = gb_d->read<float>(gb_host.size());
    }
    workspace.reset();
    if (on_device) cudaStreamDestroy(stream);
    run.log_prob[static_cast<std::size_t>(r)] = lp;
    run.entropy[static_cast<std::size_t>(r)] = en;
    dh[static_cast<std::size_t>(r)] = gh_host;
    dw[static_cast<std::size_t>(r)] = gw_host;
    db[static_cast<std::size_t>(r)] = gb_host;
    return s;
  });
  run.grad_hidden.assign(static_cast<std::size_t>(p.n * p.h), 0.0);
  for (int r = 0; r < ranks; ++r) {
    for (std::size_t k = 0; k < dh[r].size(); ++k) run.grad_hidden[k] += dh[r][k];
    for (float x : dw[r]) run.grad_weight.push_back(x);
    for (float x : db[r]) run.grad_bias.push_back(x);
  }
  return run;
}

TEST(CudaRlHead, MatchesTheCpuHeadForOneAndTwoRanksInBothModes) {
  REQUIRE_GPU();
  const PolicyHeadProblem p = policy_head_problem(37, 40, 1001, 3);
  for (const std::vector<int64_t>& sizes : {std::vector<int64_t>{1001}, std::vector<int64_t>{560, 441}}) {
    for (bool chunked : {false, true}) {
      const PolicyHeadRun want = run_policy_head(p, sizes, false, chunked);
      const PolicyHeadRun got = run_policy_head(p, sizes, true, chunked);
      const std::string label = "R " + std::to_string(sizes.size()) + (chunked ? ", chunked" : "");
      for (std::size_t r = 0; r < sizes.size(); ++r) {
        ASSERT_TRUE(want.status[r].ok()) << label << ": " << want.status[r].to_string();
        ASSERT_TRUE(got.status[r].ok()) << label << ": " << got.status[r].to_string();
        ASSERT_TRUE(got.device_status[r].ok()) << label << ": " << got.device_status[r].to_string();
        EXPECT_EQ(got.log_prob[r], got.log_prob[0]) << label;
        EXPECT_EQ(got.entropy[r], got.entropy[0]) << label;
      }
      // fp32 GEMMs in another order (cuBLAS against oneDNN): within fp32's rounding of the
      // tiles' sums, as the CPU head is of the fp64 oracle.
      EXPECT_LT(relative_error(widen(got.log_prob[0]), widen(want.log_prob[0])), 2e-6) << label;
      EXPECT_LT(relative_error(widen(got.entropy[0]), widen(want.entropy[0])), 2e-6) << label;
      EXPECT_LT(relative_error(got.grad_hidden, want.grad_hidden), 2e-5) << label;
      EXPECT_LT(relative_error(got.grad_weight, want.grad_weight), 2e-5) << label;
      EXPECT_LT(relative_error(got.grad_bias, want.grad_bias), 2e-5) << label;
    }
  }
}

TEST(CudaRlHead, ABadTemperatureIsFoundOnTheDeviceOnEveryRank) {
  REQUIRE_GPU();
  PolicyHeadProblem p = policy_head_problem(9, 16, 300, 4);
  p.temperatures[4] = 0.0f;
  const PolicyHeadRun run = run_policy_head(p, {150, 150}, true);
  for (const Status& s : run.device_status) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("temperatures"), std::string::npos) << s.message();
  }
}

TEST(CudaRlHead, SumOfSquaresIsRefusedByName) {
  REQUIRE_GPU();
  const PolicyHeadProblem p = policy_head_problem(4, 8, 20, 5);
  DeviceBuffer hidden(p.hidden.data(), p.hidden.size() * sizeof(float));
  DeviceBuffer weight(p.weight.data(), p.weight.size() * sizeof(float));
  DeviceBuffer targets(p.targets.data(), p.targets.size() * sizeof(int64_t));
  DeviceBuffer out(nullptr, 64);
  const HeadInputs inputs{TensorView::matrix(hidden.p, kFloat32, 4, 8, 8, kGpu),
                          TensorView::matrix(weight.p, kFloat32, 20, 8, 8, kGpu), nullptr};
  const TensorView y = TensorView::contiguous(targets.p, kInt64, {4}, kGpu);
  const TensorView v = TensorView::contiguous(out.p, kFloat32, {4}, kGpu);
  DeviceLoopback comm;
  Workspace workspace;
  const Status s = rl::linear_forward(comm, inputs, y, {0, 20, 20}, rl::Options{}, HeadOptions{},
                                      {nullptr, nullptr, nullptr, nullptr, &v}, nullptr, &workspace);
  EXPECT_EQ(s.code(), Code::kUnsupported);
  EXPECT_NE(s.message().find("sum_p_squared"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace vpce::test
