// tests/cuda/cuda_test.cc: the CUDA path against the CPU fp64 oracle. Needs a CUDA device:
// on a machine without one every test skips, saying so (the build and everything else are
// still tested). R ranks run as threads on one GPU, their one gather staged through the
// in-process backend (a test communicator; NCCL needs one GPU per rank); a single rank uses
// a device-to-device copy, which also lets the forward and backward be captured in a CUDA
// graph.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>

#include "cuda_step.h"
#include "cuda_support.h"
#include "support.h"

namespace vpce::test {
namespace {

struct DeviceRun {
  std::vector<Status> status;
  std::vector<Status> device_status;
  std::vector<std::vector<float>> loss, target_is_argmax, entropy;
  std::vector<std::vector<double>> lse;  // kept in float64, as vpce.torch keeps it
  std::vector<double> grad;              // [N, V]
};

// Forward and backward of `problem` on R device ranks (the problem's strided storage is
// copied to the device as is, so rows keep their stride and misalignment).
DeviceRun run_on_device(Problem& problem, const std::vector<VocabShard>& shards, const RunOptions& options,
                        const std::function<void(int, std::vector<int64_t>&)>& tweak_targets = {}) {
  const int ranks = static_cast<int>(shards.size());
  const int64_t n = problem.tokens;
  const bool reduced = options.loss.reduction != Reduction::kNone;
  DeviceBuffer logits(problem.storage.data(), problem.storage.size());
  const DataType grad_dtype = options.in_place ? problem.dtype : options.grad_dtype;
  DeviceBuffer grad(nullptr, static_cast<std::size_t>(n * problem.vocab * grad_dtype.bytes()));
  cudaMemset(grad.p, 0, grad.bytes);
  DeviceBuffer weights(options.weights.data(), options.weights.size() * sizeof(float));
  const float scalar = options.grad_scalar;
  DeviceBuffer upstream(reduced ? static_cast<const void*>(&scalar) : problem.grad_loss.data(),
                        reduced ? sizeof(float) : problem.grad_loss.size() * sizeof(float));
  DeviceRun run;
  run.device_status.resize(static_cast<std::size_t>(ranks));
  run.loss.resize(static_cast<std::size_t>(ranks));
  run.lse.resize(static_cast<std::size_t>(ranks));
  run.target_is_argmax.resize(static_cast<std::size_t>(ranks));
  run.entropy.resize(static_cast<std::size_t>(ranks));
  std::unique_ptr<ThreadGroup> group;
  // 20 s, not 5 minutes: a rank that returns early must not eat the GPU check's time.
  EXPECT_TRUE(ThreadGroup::create(ranks, &group, std::chrono::seconds(20)).ok());
  run.status = group->run([&](Communicator& host) -> Status {
    const int r = host.rank();
    StagedDeviceComm staged(host);
    DeviceLoopback loopback;
    Communicator& comm = ranks == 1 ? static_cast<Communicator&>(loopback) : staged;
    std::vector<int64_t> targets = problem.targets;
    if (tweak_targets) tweak_targets(r, targets);
    DeviceBuffer y(targets.data(), targets.size() * sizeof(int64_t));
    DeviceBuffer loss(nullptr, (reduced ? 1 : n) * sizeof(float) + 4);
    DeviceBuffer lse(nullptr, n * sizeof(double) + 8);
    DeviceBuffer argmax(nullptr, n * sizeof(float) + 4);
    DeviceBuffer entropy(nullptr, n * sizeof(float) + 4);
    const VocabShard& shard = shards[static_cast<std::size_t>(r)];
    const int64_t cols = shard.vocab_end - shard.vocab_begin;
    const Device gpu{DeviceType::kCUDA, 0};
    const TensorView x = TensorView::matrix(
        static_cast<char*>(logits.p) + problem.offset_bytes + shard.vocab_begin * problem.dtype.bytes(), problem.dtype,
        n, cols, problem.ld, gpu);
    const TensorView yv = TensorView::contiguous(y.p, kInt64, {n}, gpu);
    const TensorView lv = TensorView::contiguous(loss.p, kFloat32, {reduced ? 1 : n}, gpu);
    const TensorView ev = TensorView::contiguous(lse.p, kFloat64, {n}, gpu);
    const TensorView wv = TensorView::contiguous(weights.p, kFloat32, {n}, gpu);
    const TensorView av = TensorView::contiguous(argmax.p, kFloat32, {n}, gpu);
    const TensorView hv = TensorView::contiguous(entropy.p, kFloat32, {n}, gpu);
    ForwardExtras extras;
    extras.weights = options.weights.empty() ? nullptr : &wv;
    if (options.extras) {
      extras.target_is_argmax = &av;
      extras.entropy = &hv;
    }
    cudaStream_t stream = nullptr;
    cudaStreamCreate(&stream);
    LossOptions opts = options.loss;
    opts.stream = stream;
    std::optional<Workspace> holder(std::in_place);  // released before the stream goes
    Workspace& workspace = *holder;
    Status s = forward(comm, x, yv, shard, opts, lv, ev, extras, &workspace);
    if (s.ok()) {
      const TensorView g = TensorView::contiguous(upstream.p, kFloat32, {reduced ? 1 : n}, gpu);
      const TensorView out =
          options.in_place ? x
                           : TensorView::matrix(static_cast<char*>(grad.p) + shard.vocab_begin * grad_dtype.bytes(),
                                                grad_dtype, n, cols, problem.vocab, gpu);
      s = backward(x, yv, ev, g, shard, opts, out, extras.weights);
    }
    run.device_status[static_cast<std::size_t>(r)] = workspace.device_status();
    cudaStreamSynchronize(stream);
    run.loss[static_cast<std::size_t>(r)] = loss.read<float>(reduced ? 1 : static_cast<std::size_t>(n));
    run.lse[static_cast<std::size_t>(r)] = lse.read<double>(static_cast<std::size_t>(n));
    run.target_is_argmax[static_cast<std::size_t>(r)] = argmax.read<float>(static_cast<std::size_t>(n));
    run.entropy[static_cast<std::size_t>(r)] = entropy.read<float>(static_cast<std::size_t>(n));
    holder.reset();
    cudaStreamDestroy(stream);
    return s;
  });
  // The gradient, widened to doubles.
  std::vector<std::byte> host(problem.storage.size());
  if (options.in_place) {
    cudaMemcpy(problem.storage.data(), logits.p, problem.storage.size(), cudaMemcpyDeviceToHost);
  } else {
    host.resize(grad.bytes);
    cudaMemcpy(host.data(), grad.p, grad.bytes, cudaMemcpyDeviceToHost);
  }
  run.grad = gathered_grad(problem, options, host);
  return run;
}

void expect_matches_oracle(Problem problem, const std::vector<VocabShard>& shards, const RunOptions& options,
                           double grad_tolerance) {
  const reference::Result want = oracle(problem, options);
  DeviceRun run = run_on_device(problem, shards, options);
  for (std::size_t r = 0; r < run.status.size(); ++r) {
    ASSERT_TRUE(run.status[r].ok()) << run.status[r].to_string();
    ASSERT_TRUE(run.device_status[r].ok()) << run.device_status[r].to_string();
    EXPECT_LT(relative_error(widen(run.loss[r]), want.loss), 1e-6) << "rank " << r;
    EXPECT_LT(relative_error(widen(run.lse[r]), want.lse), 1e-6) << "rank " << r;
    EXPECT_EQ(std::memcmp(run.loss[r].data(), run.loss[0].data(), run.loss[0].size() * sizeof(float)), 0)
        << "rank " << r << "'s loss differs from rank 0's";
    if (options.extras) {
      EXPECT_EQ(widen(run.target_is_argmax[r]), want.target_is_argmax) << "rank " << r;
      EXPECT_LT(relative_error(widen(run.entropy[r]), want.entropy), 1e-5) << "rank " << r;
    }
  }
  EXPECT_LT(relative_error(run.grad, want.grad), grad_tolerance);
}

class CudaVsOracle : public testing::TestWithParam<std::tuple<DataType, int, bool>> {};

TEST_P(CudaVsOracle, PlainAndSmoothed) {
  REQUIRE_GPU();
  const auto [dtype, ranks, in_place] = GetParam();
  // fp32 within 1e-6; bf16 and fp16 gradients within their own rounding.
  const double tolerance = dtype == kFloat32 || !in_place ? 1e-5 : dtype == kBFloat16 ? 8e-3 : 1e-3;
  for (float smoothing : {0.0f, 0.1f}) {
    SCOPED_TRACE("smoothing " + std::to_string(smoothing));
    RunOptions o;
    o.in_place = in_place;
    o.loss.label_smoothing = smoothing;
    expect_matches_oracle(random_problem(37, 4099, dtype, 5), shards_from_sizes(even_splits(4099, ranks)), o,
                          tolerance);
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesRanksPlacement, CudaVsOracle,
                         testing::Combine(testing::Values(kFloat32, kBFloat16, kFloat16), testing::Values(1, 2, 4),
                                          testing::Bool()));

TEST(Cuda, EveryOption) {
  REQUIRE_GPU();
  Problem p = random_problem(29, 3001, kFloat32, 9);
  for (int64_t i = 0; i < p.tokens; i += 7) p.targets[static_cast<std::size_t>(i)] = -100;
  for (int64_t& t : p.targets) {
    if (t >= 2990) t %= 2990;
  }
  RunOptions o;
  o.loss.label_smoothing = 0.2f;
  o.loss.smoothing_semantics = SmoothingSemantics::kPyTorch;
  o.loss.z_loss_weight = 1e-3f;
  o.loss.logit_scale = 0.8f;
  o.loss.softcap = 15.0f;
  o.loss.valid_vocab_size = 2990;
  for (int64_t i = 0; i < p.tokens; ++i)
    o.weights.push_back(i % 5 == 0 ? 0.0f : 0.5f + 0.1f * static_cast<float>(i % 3));
  for (Reduction reduction : {Reduction::kNone, Reduction::kSum, Reduction::kMean}) {
    SCOPED_TRACE("reduction " + std::to_string(static_cast<int>(reduction)));
    o.loss.reduction = reduction;
    o.grad_scalar = 0.75f;
    expect_matches_oracle(p, shards_from_sizes({1000, 0, 2001}), o, 1e-5);
  }
}

TEST(Cuda, ExtrasAndEveryGradientDtype) {
  REQUIRE_GPU();
  for (DataType grad_dtype : {kFloat32, kBFloat16, kFloat16}) {
    SCOPED_TRACE("gradient " + to_string(grad_dtype));
    RunOptions o;
    o.extras = true;
    o.grad_dtype = grad_dtype;
    o.loss.label_smoothing = 0.1f;
    const double tolerance = grad_dtype == kFloat32 ? 1e-5 : grad_dtype == kBFloat16 ? 8e-3 : 1e-3;
    expect_matches_oracle(random_problem(33, 2053, kBFloat16, 12), shards_from_sizes(even_splits(2053, 3)), o,
                          tolerance);
  }
}

TEST(Cuda, EmptyBatchWithAReductionIsZero) {
  REQUIRE_GPU();
  Problem p = random_problem(0, 100, kFloat32, 2);
  RunOptions o;
  o.loss.reduction = Reduction::kMean;
  DeviceRun run = run_on_device(p, shards_from_sizes(even_splits(100, 2)), o);
  for (std::size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(run.status[r].ok()) << run.status[r].to_string();
    EXPECT_EQ(run.loss[r][0], 0.0f);
  }
}

TEST(Cuda, LongRowsAndAdversarialValues) {
  REQUIRE_GPU();
  Problem p = random_problem(4, 262144, kBFloat16, 3);
  for (int64_t v = 0; v < p.vocab; ++v) {
    p.set(0, v, v % 2 ? 1e4f : -1e4f);
    if (v % 3 == 0) p.set(1, v, -INFINITY);
  }
  if (p.targets[1] % 3 == 0) p.targets[1] += 1;
  expect_matches_oracle(p, shards_from_sizes(even_splits(262144, 2)), RunOptions{}, 1e-5);
}

// NaN singly, as whole vectors, as a row's tail and as a whole shard (with -inf beside it)
// reaches token 0's loss, lse and every gradient column, on the plain path (no extras) and
// the general one (extras); token 1 keeps its fp64 value (as Adversarial's CPU test).
TEST(Cuda, NanVectorsRowsAndShardsReachTheLoss) {
  REQUIRE_GPU();
  struct Span {
    int64_t vocab, begin, end;  // NaN in columns [begin, end) of token 0's row
    bool with_minus_inf;        // and -inf in [vocab / 2, begin)
  };
  const Span spans[] = {{1072, 1056, 1057, false},
                        {48, 32, 48, false},
                        {3000, 1000, 2024, false},
                        {64, 32, 64, true},
                        {20000, 16384, 16400, false}};
  for (const Span& span : spans) {
    for (DataType dtype : {kFloat32, kBFloat16}) {
      for (bool extras : {false, true}) {
        for (int ranks : {1, 2}) {
          Problem p = nan_span_problem(span.vocab, span.begin, span.end, span.with_minus_inf, dtype);
          const std::vector<double> x = p.as_double();
          RunOptions o;
          o.extras = extras;
          const DeviceRun run = run_on_device(p, shards_from_sizes(even_splits(span.vocab, ranks)), o);
          const std::string where = to_string(dtype) + " V " + std::to_string(span.vocab) + " NaN [" +
                                    std::to_string(span.begin) + ", " + std::to_string(span.end) + ") R " +
                                    std::to_string(ranks) + (extras ? " extras" : "");
          for (int r = 0; r < ranks; ++r) {
            ASSERT_TRUE(run.status[static_cast<std::size_t>(r)].ok()) << where;
            EXPECT_TRUE(std::isnan(run.loss[static_cast<std::size_t>(r)][0])) << where << ", rank " << r;
            EXPECT_TRUE(std::isnan(run.lse[static_cast<std::size_t>(r)][0])) << where << ", rank " << r;
          }
          for (int64_t v = 0; v < span.vocab; ++v) {
            ASSERT_TRUE(std::isnan(run.grad[static_cast<std::size_t>(v)])) << where << ", column " << v;
          }
          const auto want = reference::cross_entropy(std::vector<double>(x.begin() + span.vocab, x.end()), 1,
                                                     span.vocab, {p.targets[1]}, 0.0, {1.0});
          EXPECT_NEAR(run.loss[0][1], want.loss[0], 1e-6 * want.loss[0]) << where;
        }
      }
    }
  }
}

// Logits offset by 1e4 and -1e5: with the lse kept in float64 the gradient keeps fp32's
// accuracy (GradientConstants' factor e^(fl32(lse) - lse)), as on the CPU.
TEST(Cuda, AFloat64LseKeepsTheGradientAtFp32sAccuracyForLogitsUpTo1e9) {
  REQUIRE_GPU();
  for (double offset : {1e4, -1e5}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    Problem p = random_problem(8, 1201, kFloat32, 61);
    for (int64_t i = 0; i < p.tokens; ++i) {
      for (int64_t v = 0; v < p.vocab; ++v) p.set(i, v, static_cast<float>(p.at(i, v) + offset));
    }
    RunOptions o;
    o.loss.label_smoothing = 0.1f;
    expect_matches_oracle(p, shards_from_sizes({600, 1, 600}), o, 1e-6);
  }
}

TEST(Cuda, TargetOutOfRangeIsAnAsynchronousErrorOnEveryRank) {
  REQUIRE_GPU();
  Problem p = random_problem(8, 100, kFloat32, 1);
  const std::vector<VocabShard> shards = shards_from_sizes(even_splits(100, 2));
  DeviceRun run = run_on_device(p, shards, RunOptions{}, [](int r, std::vector<int64_t>& targets) {
    if (r == 1) targets[3] = 100;  // a bad target that only the device sees
  });
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(run.status[r].ok()) << run.status[r].to_string();  // the host saw nothing wrong
    EXPECT_EQ(run.device_status[r].code(), r == 1 ? Code::kInvalidArgument : Code::kRemoteError);
    EXPECT_NE(run.device_status[r].message().find("targets or weights"), std::string::npos)
        << run.device_status[r].to_string();
    EXPECT_TRUE(std::isnan(run.loss[r][0]));
  }
}

// A forward and backward run eagerly, then (in another workspace) warmed up on one stream and
// captured on `other_stream` or the same one, the graph replayed: the same loss and gradient,
// bit for bit.
void expect_capture_matches_eager(bool other_stream) {
  const Problem p = random_problem(64, 5000, kBFloat16, 4);
  cudaStream_t warm_up = nullptr, capture = nullptr;
  CUDA_OK(cudaStreamCreate(&warm_up));
  if (other_stream) {
    CUDA_OK(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
  } else {
    capture = warm_up;
  }
  DeviceLoopback eager_comm, comm;
  const StepOutputs eager = device_step(eager_comm, p, warm_up, nullptr);
  const StepOutputs replayed = device_step(comm, p, warm_up, capture);
  EXPECT_EQ(replayed.loss, eager.loss);
  EXPECT_EQ(replayed.grad, eager.grad);
  EXPECT_EQ(comm.calls, 2);  // the eager forward and the captured one (a replay runs no host code)
  if (other_stream) cudaStreamDestroy(capture);
  cudaStreamDestroy(warm_up);
}

TEST(Cuda, ForwardAndBackwardCaptureInACudaGraph) {
  REQUIRE_GPU();
  expect_capture_matches_eager(false);
}

// As torch.cuda.graph does: warmed up on one stream, synchronized, captured on another.
TEST(Cuda, CaptureOnAnotherStreamThanTheWarmUp) {
  REQUIRE_GPU();
  expect_capture_matches_eager(true);
}

TEST(Cuda, HostPointerLabelledAsDeviceIsRefused) {
  REQUIRE_GPU();
  std::vector<float> host(40, 0.5f), loss(4), lse(4);
  std::vector<int64_t> targets(4, 1);
  const Device gpu{DeviceType::kCUDA, 0};
  DeviceLoopback comm;
  Workspace workspace;
  const Status s = forward(comm, TensorView::contiguous(host.data(), kFloat32, {4, 10}, gpu),
                           TensorView::contiguous(targets.data(), kInt64, {4}, gpu), {0, 10, 10}, {},
                           TensorView::contiguous(loss.data(), kFloat32, {4}, gpu),
                           TensorView::contiguous(lse.data(), kFloat32, {4}, gpu), {}, &workspace);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("logits.data: expected memory of cuda:0, got host memory"), std::string::npos)
      << s.to_string();
}

}  // namespace
}  // namespace vpce::test
