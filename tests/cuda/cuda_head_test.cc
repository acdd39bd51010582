// tests/cuda/cuda_head_test.cc: the fused head (vpce/head.h) on CUDA tensors against the
// fp64 oracle: the logits x = h W^T + b computed in fp64 from the stored (rounded) operands,
// the oracle's loss and logit gradient, and the chain rule in fp64 for grad_hidden (each
// rank's part), grad_weight and grad_bias. Needs a CUDA device: without one every test
// skips, saying so. R ranks run as threads on one GPU, their gathers staged through the
// in-process backend (NCCL needs one GPU per rank); one rank gathers with a device copy,
// which lets whole steps be captured in a CUDA graph.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <random>

#include "cpu/dtype.h"
#include "cuda_support.h"
#include "reference/head_reference.h"
#include "support.h"
#include "vpce/head.h"

namespace vpce::test {
namespace {

// The head's operands stored in `dtype`: hidden [N, H] with row stride H + 1 (rows not
// aligned), weight [V, H] (rank r's rows are a slice), bias [V], targets, upstream.
struct HeadProblem {
  int64_t tokens = 0, hidden = 0, vocab = 0, ldh = 0;
  DataType dtype = kFloat32;
  bool with_bias = false;
  std::vector<std::byte> h, w, b;  // stored values
  std::vector<int64_t> targets;
  std::vector<float> grad_loss;  // per token

  double at(const std::vector<std::byte>& m, int64_t index) const {
    return detail::widen(m.data() + index * dtype.bytes(), dtype);
  }
  double hv(int64_t i, int64_t k) const { return at(h, i * ldh + k); }
  double wv(int64_t v, int64_t k) const { return at(w, v * hidden + k); }
  double bv(int64_t v) const { return with_bias ? at(b, v) : 0.0; }
  std::vector<double> logits() const {
    std::vector<double> x(static_cast<std::size_t>(tokens * vocab));
    for (int64_t i = 0; i < tokens; ++i) {
      for (int64_t v = 0; v < vocab; ++v) {
        double sum = bv(v);
        for (int64_t k = 0; k < hidden; ++k) sum += hv(i, k) * wv(v, k);
        x[static_cast<std::size_t>(i * vocab + v)] = sum;
      }
    }
    return x;
  }
};

HeadProblem head_problem(int64_t n, int64_t hidden, int64_t vocab, DataType dtype, bool bias, uint64_t seed) {
  HeadProblem p;
  p.tokens = n;
  p.hidden = hidden;
  p.vocab = vocab;
  p.ldh = hidden + 1;
  p.dtype = dtype;
  p.with_bias = bias;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto e = static_cast<std::size_t>(dtype.bytes());
  p.h.resize(static_cast<std::size_t>(n * p.ldh + 1) * e);
  p.w.resize(static_cast<std::size_t>(vocab * hidden + 1) * e);
  p.b.resize(static_cast<std::size_t>(vocab + 1) * e);
  // Logits of standard deviation about 3: h ~ N(0, 1), W ~ N(0, 3 / sqrt(H)).
  const float scale = 3.0f / std::sqrt(static_cast<float>(hidden));
  for (std::size_t k = 0; k < p.h.size() / e; ++k) detail::narrow(normal(rng), p.h.data() + k * e, dtype);
  for (std::size_t k = 0; k < p.w.size() / e; ++k) detail::narrow(scale * normal(rng), p.w.data() + k * e, dtype);
  for (std::size_t k = 0; k < p.b.size() / e; ++k) detail::narrow(0.5f * normal(rng), p.b.data() + k * e, dtype);
  std::uniform_int_distribution<int64_t> target(0, vocab - 1);
  std::uniform_real_distribution<float> upstream(0.5f, 2.0f);
  for (int64_t i = 0; i < n; ++i) {
    p.targets.push_back(target(rng));
    p.grad_loss.push_back(upstream(rng));
  }
  return p;
}

struct Want {
  reference::Result r;
  std::vector<std::vector<double>> grad_hidden;  // per rank: its part [N, H]
  std::vector<double> grad_weight;               // [V, H]
  std::vector<double> grad_bias;                 // [V]
};

struct Settings {
  LossOptions loss;
  HeadOptions head;
  std::vector<float> weights;  // per token, or empty
  float grad_scalar = 1.0f;    // upstream gradient of a reduced loss
  bool extras = false;
  bool chunked = false;  // forward_backward instead of forward + backward
  DataType grad_dtype = kFloat32;
  bool accumulate = false;  // gradients added into fp32 buffers holding 0.25
  bool int32_targets = false;
  int bad_rank = -1;  // this rank passes an lse of the wrong dtype
};

Want oracle_of(const HeadProblem& p, const std::vector<VocabShard>& shards, const Settings& s) {
  Want w;
  std::vector<double> weights(s.weights.begin(), s.weights.end());
  std::vector<double> upstream;
  if (s.loss.reduction == Reduction::kNone) {
    upstream.assign(p.grad_loss.begin(), p.grad_loss.end());
  } else {
    upstream = {static_cast<double>(s.grad_scalar)};
  }
  w.r =
      reference::cross_entropy(p.logits(), p.tokens, p.vocab, p.targets, weights, upstream, reference_options(s.loss));
  if (s.head.bf16_logit_gradients) {  // the gradients from dx rounded to bf16 (through fp32)
    for (double& g : w.r.grad) g = detail::to_float(detail::from_float<detail::BFloat16>(static_cast<float>(g)));
  }
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  auto gx = [&](int64_t i, int64_t c) { return w.r.grad[static_cast<std::size_t>(i * v + c)]; };
  for (const VocabShard& shard : shards) {
    std::vector<double> part(static_cast<std::size_t>(n * h), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = shard.vocab_begin; c < shard.vocab_end; ++c) {
        for (int64_t k = 0; k < h; ++k) part[static_cast<std::size_t>(i * h + k)] += gx(i, c) * p.wv(c, k);
      }
    }
    w.grad_hidden.push_back(part);
  }
  w.grad_weight.assign(static_cast<std::size_t>(v * h), 0.0);
  w.grad_bias.assign(static_cast<std::size_t>(v), 0.0);
  for (int64_t c = 0; c < v; ++c) {
    for (int64_t i = 0; i < n; ++i) {
      w.grad_bias[static_cast<std::size_t>(c)] += gx(i, c);
      for (int64_t k = 0; k < h; ++k) w.grad_weight[static_cast<std::size_t>(c * h + k)] += gx(i, c) * p.hv(i, k);
    }
  }
  return w;
}

struct RankRun {
  Status status;
  Status device_status;
  std::vector<float> loss, target_is_argmax, entropy;
  std::vector<double> lse;          // kept in float64, as vpce.torch keeps it
  std::vector<double> grad_hidden;  // [N, H]
  int64_t collectives = 0;
  int gathers = 0;
};

struct HeadRun {
  std::vector<RankRun> ranks;
  std::vector<double> grad_weight;  // [V, H], every rank's rows
  std::vector<double> grad_bias;    // [V]
};

std::vector<double> read_widened(const DeviceBuffer& b, std::size_t count, DataType dtype) {
  std::vector<std::byte> raw = b.read<std::byte>(count * static_cast<std::size_t>(dtype.bytes()));
  std::vector<double> out(count);
  for (std::size_t k = 0; k < count; ++k) out[k] = detail::widen(raw.data() + k * dtype.bytes(), dtype);
  return out;
}

// One step on R device ranks: forward then backward (or forward_backward), every output
// read back.
HeadRun run_head(const HeadProblem& p, const std::vector<VocabShard>& shards, const Settings& s,
                 const std::function<void(int, std::vector<int64_t>&)>& tweak_targets = {}) {
  const int ranks = static_cast<int>(shards.size());
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  const bool reduced = s.loss.reduction != Reduction::kNone;
  DeviceBuffer hidden(p.h.data(), p.h.size());
  DeviceBuffer weight(p.w.data(), p.w.size());
  DeviceBuffer bias(p.b.data(), p.b.size());
  DeviceBuffer token_weights(s.weights.data(), s.weights.size() * sizeof(float));
  const DataType gd = s.accumulate ? kFloat32 : s.grad_dtype;
  DeviceBuffer grad_weight(nullptr, static_cast<std::size_t>(v * h * gd.bytes()));
  DeviceBuffer grad_bias(nullptr, static_cast<std::size_t>(v * gd.bytes()));
  if (s.accumulate) {
    std::vector<float> quarter(static_cast<std::size_t>(v * h), 0.25f);
    cudaMemcpy(grad_weight.p, quarter.data(), grad_weight.bytes, cudaMemcpyHostToDevice);
    cudaMemcpy(grad_bias.p, quarter.data(), grad_bias.bytes, cudaMemcpyHostToDevice);
  }
  const float scalar = s.grad_scalar;
  DeviceBuffer upstream(reduced ? static_cast<const void*>(&scalar) : p.grad_loss.data(),
                        reduced ? sizeof(float) : p.grad_loss.size() * sizeof(float));
  HeadRun run;
  run.ranks.resize(static_cast<std::size_t>(ranks));
  std::unique_ptr<ThreadGroup> group;
  // 20 s, not 5 minutes: a rank that returns early must not eat the GPU check's time.
  EXPECT_TRUE(ThreadGroup::create(ranks, &group, std::chrono::seconds(20)).ok());
  const std::vector<Status> statuses = group->run([&](Communicator& host) -> Status {
    const int r = host.rank();
    RankRun& mine = run.ranks[static_cast<std::size_t>(r)];
    StagedDeviceComm staged(host);
    DeviceLoopback loopback;
    Communicator& comm = ranks == 1 ? static_cast<Communicator&>(loopback) : staged;
    std::vector<int64_t> targets = p.targets;
    if (tweak_targets) tweak_targets(r, targets);
    std::vector<int32_t> narrow_targets(targets.begin(), targets.end());
    DeviceBuffer y(s.int32_targets ? static_cast<const void*>(narrow_targets.data()) : targets.data(),
                   targets.size() * (s.int32_targets ? sizeof(int32_t) : sizeof(int64_t)));
    DeviceBuffer loss(nullptr, (reduced ? 1 : n) * sizeof(float));
    DeviceBuffer lse(nullptr, n * sizeof(double));
    DeviceBuffer argmax(nullptr, n * sizeof(float));
    DeviceBuffer entropy(nullptr, n * sizeof(float));
    DeviceBuffer grad_hidden(nullptr, static_cast<std::size_t>(n * h * gd.bytes()));
    if (s.accumulate) {
      std::vector<float> quarter(static_cast<std::size_t>(n * h), 0.25f);
      cudaMemcpy(grad_hidden.p, quarter.data(), grad_hidden.bytes, cudaMemcpyHostToDevice);
    }
    const VocabShard& shard = shards[static_cast<std::size_t>(r)];
    const int64_t rows = shard.vocab_end - shard.vocab_begin;
    const auto e = static_cast<int64_t>(p.dtype.bytes());
    const TensorView hv = TensorView::matrix(hidden.p, p.dtype, n, h, p.ldh, kGpu);
    const TensorView wv =
        TensorView::matrix(static_cast<char*>(weight.p) + shard.vocab_begin * h * e, p.dtype, rows, h, h, kGpu);
    const TensorView bv =
        TensorView::contiguous(static_cast<char*>(bias.p) + shard.vocab_begin * e, p.dtype, {rows}, kGpu);
    HeadInputs inputs{hv, wv, p.with_bias ? &bv : nullptr};
    const TensorView yv = TensorView::contiguous(y.p, s.int32_targets ? kInt32 : kInt64, {n}, kGpu);
    const TensorView lv = TensorView::contiguous(loss.p, kFloat32, {reduced ? 1 : n}, kGpu);
    const TensorView ev = TensorView::contiguous(lse.p, r == s.bad_rank ? kFloat16 : kFloat64, {n}, kGpu);
    const TensorView tw = TensorView::contiguous(token_weights.p, kFloat32, {n}, kGpu);
    const TensorView av = TensorView::contiguous(argmax.p, kFloat32, {n}, kGpu);
    const TensorView nv = TensorView::contiguous(entropy.p, kFloat32, {n}, kGpu);
    const TensorView gh = TensorView::matrix(grad_hidden.p, gd, n, h, h, kGpu);
    const TensorView gw = TensorView::matrix(static_cast<char*>(grad_weight.p) + shard.vocab_begin * h * gd.bytes(), gd,
                                             rows, h, h, kGpu);
    const TensorView gb =
        TensorView::contiguous(static_cast<char*>(grad_bias.p) + shard.vocab_begin * gd.bytes(), gd, {rows}, kGpu);
    HeadGradients grads;
    grads.hidden = {&gh, s.accumulate};
    grads.weight = {&gw, s.accumulate};
    if (p.with_bias) grads.bias = {&gb, s.accumulate};
    ForwardExtras extras;
    extras.weights = s.weights.empty() ? nullptr : &tw;
    if (s.extras) {
      extras.target_is_argmax = &av;
      extras.entropy = &nv;
    }
    cudaStream_t stream = nullptr;
    cudaStreamCreate(&stream);
    LossOptions o = s.loss;
    o.stream = stream;
    std::optional<Workspace> holder(std::in_place);  // released before its stream is destroyed
    Workspace& workspace = *holder;
    Status st;
    if (s.chunked) {
      st = linear_cross_entropy_forward_backward(comm, inputs, yv, shard, o, s.head, s.grad_scalar, lv, ev, grads,
                                                 extras, &workspace, &mine.collectives);
    } else {
      st = linear_cross_entropy_forward(comm, inputs, yv, shard, o, s.head, lv, ev, extras, &workspace);
      if (st.ok()) {
        const TensorView g = TensorView::contiguous(upstream.p, kFloat32, {reduced ? 1 : n}, kGpu);
        st = linear_cross_entropy_backward(inputs, yv, ev, g, shard, o, s.head, grads, extras.weights, &workspace);
      }
    }
    mine.device_status = workspace.device_status();
    cudaStreamSynchronize(stream);
    mine.loss = loss.read<float>(reduced ? 1 : static_cast<std::size_t>(n));
    mine.lse = lse.read<double>(static_cast<std::size_t>(n));
    mine.target_is_argmax = argmax.read<float>(static_cast<std::size_t>(n));
    mine.entropy = entropy.read<float>(static_cast<std::size_t>(n));
    mine.grad_hidden = read_widened(grad_hidden, static_cast<std::size_t>(n * h), gd);
    mine.gathers = ranks == 1 ? loopback.calls : staged.calls;
    holder.reset();
    cudaStreamDestroy(stream);
    return st;
  });
  for (int r = 0; r < ranks; ++r) run.ranks[static_cast<std::size_t>(r)].status = statuses[static_cast<std::size_t>(r)];
  run.grad_weight = read_widened(grad_weight, static_cast<std::size_t>(v * h), gd);
  run.grad_bias = read_widened(grad_bias, static_cast<std::size_t>(v), gd);
  return run;
}

std::vector<double> minus(std::vector<double> a, double value) {
  for (double& x : a) x -= value;
  return a;
}

// Loss and lse within loss_tolerance, the gradients within grad_tolerance, every rank's loss
// bit-identical.
void expect_matches_oracle(const HeadProblem& p, const std::vector<VocabShard>& shards, const Settings& s,
                           double loss_tolerance, double grad_tolerance) {
  const Want want = oracle_of(p, shards, s);
  const HeadRun run = run_head(p, shards, s);
  const double offset = s.accumulate ? 0.25 : 0.0;
  for (std::size_t r = 0; r < run.ranks.size(); ++r) {
    const RankRun& got = run.ranks[r];
    ASSERT_TRUE(got.status.ok()) << got.status.to_string();
    ASSERT_TRUE(got.device_status.ok()) << got.device_status.to_string();
    EXPECT_LT(relative_error(widen(got.loss), want.r.loss), loss_tolerance) << "rank " << r;
    EXPECT_LT(relative_error(widen(got.lse), want.r.lse), loss_tolerance) << "rank " << r;
    EXPECT_EQ(std::memcmp(got.loss.data(), run.ranks[0].loss.data(), got.loss.size() * sizeof(float)), 0)
        << "rank " << r << "'s loss differs from rank 0's";
    if (s.extras) {
      EXPECT_EQ(widen(got.target_is_argmax), want.r.target_is_argmax) << "rank " << r;
      EXPECT_LT(relative_error(widen(got.entropy), want.r.entropy), 1e-5) << "rank " << r;
    }
    EXPECT_LT(relative_error(minus(got.grad_hidden, offset), want.grad_hidden[r]), grad_tolerance)
        << "grad_hidden of rank " << r;
  }
  EXPECT_LT(relative_error(minus(run.grad_weight, offset), want.grad_weight), grad_tolerance) << "grad_weight";
  if (p.with_bias) {
    EXPECT_LT(relative_error(minus(run.grad_bias, offset), want.grad_bias), grad_tolerance) << "grad_bias";
  }
}

// fp32 operands: fp32 GEMMs; bf16: the gradient's two bf16 parts (2^-16); fp16: widened.
double grad_tolerance_for(DataType operands, DataType grad) {
  if (grad == kBFloat16) return 8e-3;
  if (grad == kFloat16) return 1e-3;
  return operands == kBFloat16 ? 5e-5 : 2e-5;
}

class CudaHeadVsOracle : public testing::TestWithParam<std::tuple<DataType, int, bool, bool>> {};

TEST_P(CudaHeadVsOracle, PlainAndSmoothed) {
  REQUIRE_GPU();
  const auto [dtype, ranks, bias, chunked] = GetParam();
  const HeadProblem p = head_problem(37, 40, 1001, dtype, bias, 7);
  for (float smoothing : {0.0f, 0.1f}) {
    SCOPED_TRACE("smoothing " + std::to_string(smoothing));
    Settings s;
    s.loss.label_smoothing = smoothing;
    s.chunked = chunked;
    if (chunked) s.loss.reduction = Reduction::kMean;
    s.head.token_block = 16;  // several tiles each way, and several chunks
    s.head.vocab_block = 96;
    s.head.chunk_tokens = 16;
    expect_matches_oracle(p, shards_from_sizes(even_splits(1001, ranks)), s, 1e-5, grad_tolerance_for(dtype, kFloat32));
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesRanksBiasMode, CudaHeadVsOracle,
                         testing::Combine(testing::Values(kFloat32, kBFloat16, kFloat16), testing::Values(1, 2, 4),
                                          testing::Bool(), testing::Bool()),
                         [](const testing::TestParamInfo<CudaHeadVsOracle::ParamType>& info) {
                           return to_string(std::get<0>(info.param)) + "_R" + std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_bias" : "_nobias") +
                                  (std::get<3>(info.param) ? "_chunked" : "_recompute");
                         });

TEST(CudaHead, DefaultTilesAndOneTile) {
  REQUIRE_GPU();
  const HeadProblem p = head_problem(70, 64, 3000, kBFloat16, true, 11);
  Settings s;
  expect_matches_oracle(p, shards_from_sizes(even_splits(3000, 2)), s, 1e-5, grad_tolerance_for(kBFloat16, kFloat32));
  s.chunked = true;
  s.loss.reduction = Reduction::kSum;
  expect_matches_oracle(p, shards_from_sizes(even_splits(3000, 2)), s, 1e-5, grad_tolerance_for(kBFloat16, kFloat32));
}

// HeadOptions::bf16_logit_gradients: one tensor-core GEMM of dz rounded to bf16; the loss
// unchanged; the gradients within 8e-3 of the exact oracle's largest element (dx's rounding,
// 2^-8 of each term) and far nearer the oracle of rounded dx than the exact oracle is (the
// 2-norm distance at most a quarter of that, as on the CPU: an fp32 dz, or its exact split,
// fails this), both modes, uneven ranges.
TEST(CudaHead, Bf16LogitGradientsWithinTheirRounding) {
  REQUIRE_GPU();
  const HeadProblem p = head_problem(70, 64, 3000, kBFloat16, true, 13);
  const std::vector<VocabShard> shards = shards_from_sizes({1200, 1800});
  auto distance = [](const std::vector<double>& a, const std::vector<double>& b) {
    double sum = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) sum += (a[i] - b[i]) * (a[i] - b[i]);
    return std::sqrt(sum);
  };
  for (bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "recompute");
    Settings s;
    s.chunked = chunked;
    s.loss.reduction = Reduction::kMean;
    s.loss.label_smoothing = 0.1f;
    s.head.bf16_logit_gradients = true;
    Settings exact_settings = s;
    exact_settings.head.bf16_logit_gradients = false;
    const Want exact = oracle_of(p, shards, exact_settings), rounded = oracle_of(p, shards, s);
    const HeadRun run = run_head(p, shards, s);
    for (std::size_t r = 0; r < run.ranks.size(); ++r) {
      const RankRun& got = run.ranks[r];
      ASSERT_TRUE(got.status.ok()) << got.status.to_string();
      ASSERT_TRUE(got.device_status.ok()) << got.device_status.to_string();
      EXPECT_LT(relative_error(widen(got.loss), exact.r.loss), 1e-5);
      EXPECT_LT(relative_error(got.grad_hidden, exact.grad_hidden[r]), 8e-3);
      EXPECT_LE(distance(got.grad_hidden, rounded.grad_hidden[r]),
                0.25 * distance(exact.grad_hidden[r], rounded.grad_hidden[r]));
    }
    EXPECT_LT(relative_error(run.grad_weight, exact.grad_weight), 8e-3);
    EXPECT_LE(distance(run.grad_weight, rounded.grad_weight), 0.25 * distance(exact.grad_weight, rounded.grad_weight));
    EXPECT_LE(distance(run.grad_bias, rounded.grad_bias), 0.25 * distance(exact.grad_bias, rounded.grad_bias));
  }
}

// round_logits (bf16: the product rounded, then its sum with the bias) with Megatron's
// legacy smoothing (each rank over its own rows), in both modes, against each rank's oracle.
// Exact products (integer hidden states, weights in 64ths) keep the GEMMs' fp32 sums exact,
// so every rounding is the oracle's.
TEST(CudaHead, RoundLogitsAndLegacySmoothing) {
  REQUIRE_GPU();
  HeadProblem p = head_problem(40, 32, 300, kBFloat16, true, 21);
  std::mt19937_64 rng(3);
  const auto e = static_cast<std::size_t>(p.dtype.bytes());
  for (std::size_t k = 0; k < p.h.size() / e; ++k) {
    detail::narrow(static_cast<float>(static_cast<int>(rng() % 17) - 8), p.h.data() + k * e, p.dtype);
  }
  for (std::size_t k = 0; k < p.w.size() / e; ++k) {
    detail::narrow(static_cast<float>(static_cast<int>(rng() % 129) - 64) / 64.0f, p.w.data() + k * e, p.dtype);
  }
  const std::vector<VocabShard> shards = shards_from_sizes({120, 180});
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  std::vector<double> hidden(static_cast<std::size_t>(n * h)), weight(static_cast<std::size_t>(v * h)), bias;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < h; ++k) hidden[static_cast<std::size_t>(i * h + k)] = p.hv(i, k);
  }
  for (int64_t c = 0; c < v; ++c) {
    for (int64_t k = 0; k < h; ++k) weight[static_cast<std::size_t>(c * h + k)] = p.wv(c, k);
    bias.push_back(p.bv(c));
  }
  for (bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "recompute");
    Settings s;
    s.chunked = chunked;
    s.loss.reduction = chunked ? Reduction::kMean : Reduction::kNone;
    s.loss.label_smoothing = 0.1f;
    s.loss.smoothing_semantics = SmoothingSemantics::kMegatronLegacy;
    s.head.round_logits = true;
    const HeadRun run = run_head(p, shards, s);
    for (std::size_t r = 0; r < shards.size(); ++r) {
      const RankRun& got = run.ranks[r];
      ASSERT_TRUE(got.status.ok()) << got.status.to_string();
      ASSERT_TRUE(got.device_status.ok()) << got.device_status.to_string();
      reference::Options o = reference_options(s.loss);
      o.smoothing_begin = shards[r].vocab_begin;
      o.smoothing_end = shards[r].vocab_end;
      const std::vector<double> upstream =
          chunked ? std::vector<double>{1.0} : std::vector<double>(p.grad_loss.begin(), p.grad_loss.end());
      const reference::HeadResult want = reference::linear_cross_entropy(hidden, weight, bias, n, h, v, p.targets, {},
                                                                         upstream, o, false, /*logit_bits=*/8);
      EXPECT_LT(relative_error(widen(got.loss), want.loss.loss), 1e-5) << "rank " << r;
      std::vector<double> part(static_cast<std::size_t>(n * h), 0.0), rows, want_rows;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = shards[r].vocab_begin; c < shards[r].vocab_end; ++c) {
          const double dx = want.loss.grad[static_cast<std::size_t>(i * v + c)];
          for (int64_t k = 0; k < h; ++k) part[static_cast<std::size_t>(i * h + k)] += dx * p.wv(c, k);
        }
      }
      EXPECT_LT(relative_error(got.grad_hidden, part), 1e-5) << "rank " << r;
      for (int64_t c = shards[r].vocab_begin; c < shards[r].vocab_end; ++c) {
        for (int64_t k = 0; k < h; ++k) {
          rows.push_back(run.grad_weight[static_cast<std::size_t>(c * h + k)]);
          want_rows.push_back(want.grad_weight[static_cast<std::size_t>(c * h + k)]);
        }
      }
      EXPECT_LT(relative_error(rows, want_rows), 1e-5) << "rank " << r;
    }
  }
}

TEST(CudaHead, EveryOptionEveryReduction) {
  REQUIRE_GPU();
  HeadProblem p = head_problem(29, 24, 1000, kFloat32, true, 9);
  for (int64_t i = 0; i < p.tokens; i += 7) p.targets[static_cast<std::size_t>(i)] = -100;
  for (int64_t& t : p.targets) {
    if (t >= 990) t %= 990;
  }
  Settings s;
  s.loss.label_smoothing = 0.2f;
  s.loss.smoothing_semantics = SmoothingSemantics::kPyTorch;
  s.loss.z_loss_weight = 1e-3f;
  s.loss.logit_scale = 0.8f;
  s.loss.softcap = 15.0f;
  s.loss.valid_vocab_size = 990;
  s.extras = true;
  s.head.token_block = 8;
  s.head.vocab_block = 128;
  s.head.chunk_tokens = 16;
  for (int64_t i = 0; i < p.tokens; ++i)
    s.weights.push_back(i % 5 == 0 ? 0.0f : 0.5f + 0.1f * static_cast<float>(i % 3));
  for (bool chunked : {false, true}) {
    for (Reduction reduction : {Reduction::kNone, Reduction::kSum, Reduction::kMean}) {
      if (chunked && reduction == Reduction::kNone) continue;
      SCOPED_TRACE(std::string(chunked ? "chunked" : "recompute") + " reduction " +
                   std::to_string(static_cast<int>(reduction)));
      s.loss.reduction = reduction;
      s.chunked = chunked;
      s.grad_scalar = 0.75f;
      expect_matches_oracle(p, shards_from_sizes({400, 0, 600}), s, 1e-5, 2e-5);
    }
  }
}

TEST(CudaHead, Int32Targets) {
  REQUIRE_GPU();
  HeadProblem p = head_problem(21, 16, 300, kFloat32, true, 13);
  p.targets[4] = -100;
  Settings s;
  s.int32_targets = true;
  s.head.vocab_block = 64;
  expect_matches_oracle(p, shards_from_sizes(even_splits(300, 2)), s, 1e-5, 2e-5);
  s.chunked = true;
  s.loss.reduction = Reduction::kMean;
  expect_matches_oracle(p, shards_from_sizes(even_splits(300, 2)), s, 1e-5, 2e-5);
}

// A rank whose own arguments are bad still joins the gather: it returns its error, the
// others learn it from the device (NaN outputs, the same message from device_status()).
TEST(CudaHead, ARankWithBadArgumentsStillJoins) {
  REQUIRE_GPU();
  const HeadProblem p = head_problem(24, 16, 200, kFloat32, false, 14);
  for (bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "recompute");
    Settings s;
    s.bad_rank = 1;
    s.chunked = chunked;
    s.loss.reduction = chunked ? Reduction::kSum : Reduction::kNone;
    s.head.token_block = 8;
    s.head.chunk_tokens = 8;
    const HeadRun run = run_head(p, shards_from_sizes(even_splits(200, 3)), s);
    for (std::size_t r = 0; r < 3; ++r) {
      const RankRun& got = run.ranks[r];
      if (r == 1) {
        EXPECT_EQ(got.status.code(), Code::kInvalidArgument) << got.status.to_string();
        EXPECT_NE(got.status.message().find("lse.dtype"), std::string::npos) << got.status.to_string();
      } else {
        EXPECT_TRUE(got.status.ok()) << got.status.to_string();
        EXPECT_EQ(got.device_status.code(), Code::kRemoteError) << got.device_status.to_string();
        EXPECT_NE(got.device_status.message().find("lse.dtype"), std::string::npos) << got.device_status.to_string();
        EXPECT_TRUE(std::isnan(got.loss[0]));
      }
      EXPECT_EQ(got.gathers, chunked ? 3 : 1) << "rank " << r;  // 24 tokens in chunks of 8
    }
  }
}

TEST(CudaHead, GradientDtypesAndAccumulation) {
  REQUIRE_GPU();
  for (DataType dtype : {kBFloat16, kFloat16}) {
    const HeadProblem p = head_problem(33, 48, 777, dtype, true, 12);
    for (bool chunked : {false, true}) {
      SCOPED_TRACE(to_string(dtype) + (chunked ? " chunked" : " recompute"));
      Settings s;
      s.chunked = chunked;
      s.loss.reduction = Reduction::kMean;
      s.head.token_block = 16;
      s.head.vocab_block = 100;
      s.head.chunk_tokens = 16;
      s.grad_dtype = dtype;  // written over in the operands' dtype
      expect_matches_oracle(p, shards_from_sizes(even_splits(777, 3)), s, 1e-5, grad_tolerance_for(dtype, dtype));
      s.accumulate = true;  // added into fp32
      expect_matches_oracle(p, shards_from_sizes(even_splits(777, 3)), s, 1e-5, grad_tolerance_for(dtype, kFloat32));
    }
  }
}

// The chunked mode's loss, lse and extras are the recompute forward's, bit for bit (the same
// tiles), with one gather per chunk; its gradients agree with the backward's.
TEST(CudaHead, ChunkedMatchesRecompute) {
  REQUIRE_GPU();
  // Panels of 128 rows and blocks of 8 tokens: every tile starts 256-byte aligned in both
  // modes' buffers, so that cuBLAS picks the same kernel for it.
  const HeadProblem p = head_problem(50, 32, 1024, kBFloat16, true, 5);
  Settings s;
  s.loss.reduction = Reduction::kMean;
  s.loss.label_smoothing = 0.1f;
  s.extras = true;
  s.head.token_block = 8;
  s.head.vocab_block = 128;
  s.head.chunk_tokens = 16;
  const std::vector<VocabShard> shards = shards_from_sizes(even_splits(1024, 2));
  const HeadRun recompute = run_head(p, shards, s);
  s.chunked = true;
  const HeadRun chunked = run_head(p, shards, s);
  for (std::size_t r = 0; r < shards.size(); ++r) {
    const RankRun& a = recompute.ranks[r];
    const RankRun& b = chunked.ranks[r];
    ASSERT_TRUE(a.status.ok()) << a.status.to_string();
    ASSERT_TRUE(b.status.ok()) << b.status.to_string();
    EXPECT_EQ(a.loss, b.loss) << "rank " << r;
    EXPECT_EQ(a.lse, b.lse) << "rank " << r;
    EXPECT_EQ(a.entropy, b.entropy) << "rank " << r;
    EXPECT_EQ(a.target_is_argmax, b.target_is_argmax) << "rank " << r;
    EXPECT_EQ(b.collectives, 4) << "rank " << r;  // 50 tokens in chunks of 16
    EXPECT_EQ(b.gathers, 4) << "rank " << r;
    EXPECT_EQ(a.gathers, 1) << "rank " << r;
    EXPECT_LT(relative_error(b.grad_hidden, a.grad_hidden), 1e-6) << "rank " << r;
  }
  EXPECT_LT(relative_error(chunked.grad_weight, recompute.grad_weight), 1e-6);
  EXPECT_LT(relative_error(chunked.grad_bias, recompute.grad_bias), 1e-6);
}

TEST(CudaHead, RunToRunBitIdentical) {
  REQUIRE_GPU();
  const HeadProblem p = head_problem(40, 64, 1500, kBFloat16, true, 3);
  Settings s;
  s.head.token_block = 16;
  s.head.vocab_block = 256;
  const std::vector<VocabShard> shards = shards_from_sizes(even_splits(1500, 2));
  const HeadRun a = run_head(p, shards, s);
  const HeadRun b = run_head(p, shards, s);
  for (std::size_t r = 0; r < shards.size(); ++r) {
    EXPECT_EQ(a.ranks[r].loss, b.ranks[r].loss);
    EXPECT_EQ(a.ranks[r].grad_hidden, b.ranks[r].grad_hidden);
  }
  EXPECT_EQ(a.grad_weight, b.grad_weight);
  EXPECT_EQ(a.grad_bias, b.grad_bias);
}

TEST(CudaHead, EmptyBatchAndEmptyShard) {
  REQUIRE_GPU();
  for (bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "recompute");
    const HeadProblem p = head_problem(0, 16, 100, kFloat32, true, 2);
    Settings s;
    s.chunked = chunked;
    s.loss.reduction = Reduction::kMean;
    const HeadRun run = run_head(p, shards_from_sizes({60, 0, 40}), s);
    for (const RankRun& r : run.ranks) {
      ASSERT_TRUE(r.status.ok()) << r.status.to_string();
      EXPECT_EQ(r.loss[0], 0.0f);
    }
    for (double g : run.grad_weight) EXPECT_EQ(g, 0.0);  // written over with zeros
    for (double g : run.grad_bias) EXPECT_EQ(g, 0.0);
  }
}

TEST(CudaHead, TargetOutOfRangeIsAnAsynchronousErrorOnEveryRank) {
  REQUIRE_GPU();
  const HeadProblem p = head_problem(40, 16, 100, kFloat32, false, 1);
  for (bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "recompute");
    Settings s;
    s.chunked = chunked;
    s.loss.reduction = chunked ? Reduction::kSum : Reduction::kNone;
    s.head.token_block = 8;
    s.head.chunk_tokens = 16;
    const HeadRun run =
        run_head(p, shards_from_sizes(even_splits(100, 2)), s, [](int r, std::vector<int64_t>& targets) {
          if (r == 1) targets[3] = 100;  // only the device sees it, in the first of three chunks
        });
    for (std::size_t r = 0; r < 2; ++r) {
      const RankRun& got = run.ranks[r];
      EXPECT_TRUE(got.status.ok()) << got.status.to_string();  // the host saw nothing wrong
      EXPECT_EQ(got.device_status.code(), r == 1 ? Code::kInvalidArgument : Code::kRemoteError)
          << got.device_status.to_string();
      EXPECT_NE(got.device_status.message().find("targets or weights"), std::string::npos)
          << got.device_status.to_string();
      EXPECT_TRUE(std::isnan(got.loss[0]));
      EXPECT_TRUE(std::isnan(got.lse[0]));  // in the first chunk, before the last gather
      if (chunked) EXPECT_TRUE(std::isnan(got.grad_hidden[0]));
    }
  }
}

// A second step of the same sizes captured in a CUDA graph replays bit-identically: the
// recompute forward + backward, and the chunked step.
// Warmed up on one stream, then captured on the same one or (as torch.cuda.graph does, after a
// synchronize) on another.
TEST(CudaHead, StepsCaptureInACudaGraph) {
  REQUIRE_GPU();
  const HeadProblem p = head_problem(64, 64, 2000, kBFloat16, true, 4);
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  DeviceBuffer hidden(p.h.data(), p.h.size()), weight(p.w.data(), p.w.size()), bias(p.b.data(), p.b.size());
  DeviceBuffer y(p.targets.data(), p.targets.size() * sizeof(int64_t));
  DeviceBuffer loss(nullptr, n * sizeof(float)), lse(nullptr, n * sizeof(float));
  DeviceBuffer upstream(p.grad_loss.data(), n * sizeof(float));
  DeviceBuffer gh(nullptr, n * h * sizeof(float)), gw(nullptr, v * h * sizeof(float)), gb(nullptr, v * sizeof(float));
  const TensorView hv = TensorView::matrix(hidden.p, p.dtype, n, h, p.ldh, kGpu);
  const TensorView wv = TensorView::matrix(weight.p, p.dtype, v, h, h, kGpu);
  const TensorView bv = TensorView::contiguous(bias.p, p.dtype, {v}, kGpu);
  const HeadInputs inputs{hv, wv, &bv};
  const TensorView yv = TensorView::contiguous(y.p, kInt64, {n}, kGpu);
  const TensorView ev = TensorView::contiguous(lse.p, kFloat32, {n}, kGpu);
  const TensorView ghv = TensorView::contiguous(gh.p, kFloat32, {n, h}, kGpu);
  const TensorView gwv = TensorView::contiguous(gw.p, kFloat32, {v, h}, kGpu);
  const TensorView gbv = TensorView::contiguous(gb.p, kFloat32, {v}, kGpu);
  HeadGradients grads;
  grads.hidden = {&ghv, false};
  grads.weight = {&gwv, false};
  grads.bias = {&gbv, false};
  HeadOptions head;
  head.token_block = 16;
  head.vocab_block = 512;
  head.chunk_tokens = 32;
  cudaStream_t stream = nullptr, other = nullptr;
  CUDA_OK(cudaStreamCreate(&stream));
  CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  for (auto [chunked, capture] :
       {std::pair{false, stream}, std::pair{true, stream}, std::pair{false, other}, std::pair{true, other}}) {
    SCOPED_TRACE(std::string(chunked ? "chunked" : "recompute") + (capture == other ? ", another stream" : ""));
    LossOptions o;
    o.stream = stream;
    o.reduction = chunked ? Reduction::kMean : Reduction::kNone;
    const TensorView lv = TensorView::contiguous(loss.p, kFloat32, {chunked ? 1 : n}, kGpu);
    const TensorView g = TensorView::contiguous(upstream.p, kFloat32, {n}, kGpu);
    DeviceLoopback comm;
    std::optional<Workspace> holder(std::in_place);  // released before the streams go
    Workspace& workspace = *holder;
    auto step = [&] {
      if (chunked) {
        ASSERT_TRUE(linear_cross_entropy_forward_backward(comm, inputs, yv, {0, v, v}, o, head, 1.0f, lv, ev, grads, {},
                                                          &workspace)
                        .ok());
      } else {
        ASSERT_TRUE(linear_cross_entropy_forward(comm, inputs, yv, {0, v, v}, o, head, lv, ev, {}, &workspace).ok());
        ASSERT_TRUE(
            linear_cross_entropy_backward(inputs, yv, ev, g, {0, v, v}, o, head, grads, nullptr, &workspace).ok());
      }
    };
    step();  // grows the workspace and makes the cuBLAS handle
    CUDA_OK(cudaStreamSynchronize(stream));
    const std::size_t losses = chunked ? 1 : static_cast<std::size_t>(n);  // the mean, or one per token
    const std::vector<float> eager_loss = loss.read<float>(losses), eager_gh = gh.read<float>(n * h),
                             eager_gw = gw.read<float>(v * h), eager_gb = gb.read<float>(v);
    for (DeviceBuffer* b : {&loss, &gh, &gw, &gb}) CUDA_OK(cudaMemsetAsync(b->p, 0, b->bytes, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const int eager_gathers = comm.calls;
    o.stream = capture;
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(capture, cudaStreamCaptureModeGlobal));
    step();
    CUDA_OK(cudaStreamEndCapture(capture, &graph));
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, capture));
    CUDA_OK(cudaStreamSynchronize(capture));
    EXPECT_TRUE(workspace.device_status().ok());
    EXPECT_EQ(loss.read<float>(losses), eager_loss);
    EXPECT_EQ(gh.read<float>(n * h), eager_gh);
    EXPECT_EQ(gw.read<float>(v * h), eager_gw);
    EXPECT_EQ(gb.read<float>(v), eager_gb);
    EXPECT_EQ(comm.calls, 2 * eager_gathers);  // a replay runs no host code
    holder.reset();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(other);
  cudaStreamDestroy(stream);
}

// The staged statistics on the device agree with the CPU's on the same operands.
TEST(CudaHead, LocalStatsMatchTheCpu) {
  REQUIRE_GPU();
  const HeadProblem p = head_problem(20, 32, 500, kFloat32, true, 8);
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  DeviceBuffer hidden(p.h.data(), p.h.size()), weight(p.w.data(), p.w.size()), bias(p.b.data(), p.b.size());
  DeviceBuffer y(p.targets.data(), p.targets.size() * sizeof(int64_t));
  DeviceBuffer stats(nullptr, n * 6 * sizeof(float));
  const VocabShard shard{100, 400, v};
  const auto rows = shard.vocab_end - shard.vocab_begin;
  const std::size_t e = 4;
  auto inputs_at = [&](const void* hp, const void* wp, const void* bp, Device d, TensorView* views) {
    views[0] = TensorView::matrix(hp, kFloat32, n, h, p.ldh, d);
    views[1] = TensorView::matrix(static_cast<const char*>(wp) + shard.vocab_begin * h * e, kFloat32, rows, h, h, d);
    views[2] = TensorView::contiguous(static_cast<const char*>(bp) + shard.vocab_begin * e, kFloat32, {rows}, d);
  };
  TensorView dv[3], cv[3];
  inputs_at(hidden.p, weight.p, bias.p, kGpu, dv);
  inputs_at(p.h.data(), p.w.data(), p.b.data(), Device{}, cv);
  HeadOptions head;
  head.vocab_block = 64;
  LossOptions o;
  o.label_smoothing = 0.1f;
  ASSERT_TRUE(linear_cross_entropy_local_stats({dv[0], dv[1], &dv[2]}, TensorView::contiguous(y.p, kInt64, {n}, kGpu),
                                               shard, o, head, TensorView::contiguous(stats.p, kFloat32, {n, 6}, kGpu))
                  .ok());
  std::vector<float> cpu(static_cast<std::size_t>(n * 6));
  ASSERT_TRUE(linear_cross_entropy_local_stats({cv[0], cv[1], &cv[2]},
                                               TensorView::contiguous(p.targets.data(), kInt64, {n}), shard, o, head,
                                               TensorView::contiguous(cpu.data(), kFloat32, {n, 6}))
                  .ok());
  const std::vector<float> gpu = stats.read<float>(static_cast<std::size_t>(n * 6));
  for (int64_t i = 0; i < n; ++i) {
    for (int k : {0, 1, 2, 3, 5}) {
      const float a = gpu[static_cast<std::size_t>(i * 6 + k)], b = cpu[static_cast<std::size_t>(i * 6 + k)];
      if (std::isinf(b)) {  // a target on another rank's shard: -inf on both
        EXPECT_EQ(a, b) << "token " << i << " field " << k;
      } else {
        EXPECT_NEAR(a, b, 1e-5 * (1.0 + std::fabs(b))) << "token " << i << " field " << k;
      }
    }
    int32_t a = 0, b = 0;  // the argmax travels as an int32 in a float's bits
    std::memcpy(&a, &gpu[static_cast<std::size_t>(i * 6 + 4)], 4);
    std::memcpy(&b, &cpu[static_cast<std::size_t>(i * 6 + 4)], 4);
    EXPECT_EQ(a, b) << "argmax " << i;
  }
}

TEST(CudaHead, BadArgumentsAreRefusedByName) {
  REQUIRE_GPU();
  const int64_t n = 4, h = 8, v = 10;
  std::vector<float> host(128, 0.5f);
  DeviceBuffer hidden(host.data(), n * h * 4), weight(host.data(), v * h * 4), y(nullptr, n * 8), loss(nullptr, n * 4),
      lse(nullptr, n * 4), gh(nullptr, n * h * 4);
  const HeadInputs good{TensorView::contiguous(hidden.p, kFloat32, {n, h}, kGpu),
                        TensorView::contiguous(weight.p, kFloat32, {v, h}, kGpu), nullptr};
  const TensorView yv = TensorView::contiguous(y.p, kInt64, {n}, kGpu);
  const TensorView lv = TensorView::contiguous(loss.p, kFloat32, {n}, kGpu);
  const TensorView ev = TensorView::contiguous(lse.p, kFloat32, {n}, kGpu);
  DeviceLoopback comm;
  Workspace workspace;
  auto forward = [&](const HeadInputs& in, const LossOptions& o = {}) {
    return linear_cross_entropy_forward(comm, in, yv, {0, v, v}, o, {}, lv, ev, {}, &workspace);
  };
  // A host pointer labelled as device memory.
  HeadInputs bad = good;
  bad.weight = TensorView::contiguous(host.data(), kFloat32, {v, h}, kGpu);
  Status s = forward(bad);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("weight.data: expected memory of cuda:0, got host memory"), std::string::npos)
      << s.to_string();
  // The weight on the CPU.
  bad.weight = TensorView::contiguous(host.data(), kFloat32, {v, h});
  s = forward(bad);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("weight.device"), std::string::npos) << s.to_string();
  // H that disagrees.
  bad.weight = TensorView::contiguous(weight.p, kFloat32, {v, h - 1}, kGpu);
  s = forward(bad);
  EXPECT_NE(s.message().find("weight.shape[1]"), std::string::npos) << s.to_string();
  // No workspace.
  s = linear_cross_entropy_forward(comm, good, yv, {0, v, v}, {}, {}, lv, ev, {}, nullptr);
  EXPECT_NE(s.message().find("workspace: expected a Workspace"), std::string::npos) << s.to_string();
  // The chunked mode needs a reduced loss.
  const TensorView ghv = TensorView::contiguous(gh.p, kFloat32, {n, h}, kGpu);
  HeadGradients grads;
  grads.hidden = {&ghv, false};
  s = linear_cross_entropy_forward_backward(comm, good, yv, {0, v, v}, {}, {}, 1.0f, lv, ev, grads, {}, &workspace);
  EXPECT_NE(s.message().find("options.reduction"), std::string::npos) << s.to_string();
  // A gradient of the wrong dtype, and one over an input.
  const TensorView wrong = TensorView::contiguous(gh.p, kBFloat16, {n, h}, kGpu);
  grads.hidden = {&wrong, false};
  s = linear_cross_entropy_backward(good, yv, ev, TensorView::contiguous(lse.p, kFloat32, {n}, kGpu), {0, v, v}, {}, {},
                                    grads, nullptr, &workspace);
  EXPECT_NE(s.message().find("grad_hidden.dtype"), std::string::npos) << s.to_string();
  grads.hidden = {&good.hidden, false};
  s = linear_cross_entropy_backward(good, yv, ev, TensorView::contiguous(lse.p, kFloat32, {n}, kGpu), {0, v, v}, {}, {},
                                    grads, nullptr, &workspace);
  EXPECT_NE(s.message().find("grad_hidden: expected memory that does not overlap hidden"), std::string::npos)
      << s.to_string();
  EXPECT_EQ(comm.calls, 5);  // a rank with bad arguments still joins its gathers (the backward has none)
}

}  // namespace
}  // namespace vpce::test
