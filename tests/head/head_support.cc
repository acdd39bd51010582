// tests/head/head_support.cc: the fused head's test problems and oracle (head_support.h).
#include "head_support.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <random>

#include "cpu/dtype.h"

namespace vpce::test {

double HeadProblem::hidden_at(int64_t i, int64_t k) const {
  return detail::widen(hidden_storage.data() + dtype.bytes() + (i * ld_hidden + k) * dtype.bytes(), dtype);
}
double HeadProblem::weight_at(int64_t v, int64_t k) const {
  return detail::widen(weight_storage.data() + (v * ld_weight + k) * dtype.bytes(), dtype);
}
double HeadProblem::bias_at(int64_t v) const {
  return with_bias ? detail::widen(bias_storage.data() + v * dtype.bytes(), dtype) : 0.0;
}
void HeadProblem::set_hidden(int64_t i, int64_t k, float value) {
  detail::narrow(value, hidden_storage.data() + dtype.bytes() + (i * ld_hidden + k) * dtype.bytes(), dtype);
}
void HeadProblem::set_bias(int64_t v, float value) {
  detail::narrow(value, bias_storage.data() + v * dtype.bytes(), dtype);
}

TensorView HeadProblem::hidden_view() { return TensorView::matrix(hidden_base(), dtype, tokens, hidden, ld_hidden); }
TensorView HeadProblem::weight_view(int64_t begin, int64_t end) {
  return TensorView::matrix(weight_base() + begin * ld_weight * dtype.bytes(), dtype, end - begin, hidden, ld_weight);
}
TensorView HeadProblem::bias_view(int64_t begin, int64_t end) {
  return TensorView::contiguous(bias_storage.data() + begin * dtype.bytes(), dtype, {end - begin});
}

HeadProblem random_head_problem(int64_t tokens, int64_t hidden, int64_t vocab, DataType dtype, uint64_t seed, float std,
                                bool with_bias) {
  HeadProblem p;
  p.tokens = tokens;
  p.hidden = hidden;
  p.vocab = vocab;
  p.dtype = dtype;
  p.with_bias = with_bias;
  p.ld_hidden = hidden + 3;
  p.ld_weight = hidden + 5;
  const int bytes = dtype.bytes();
  p.hidden_storage.resize(static_cast<std::size_t>((tokens * p.ld_hidden + 1) * bytes));
  p.weight_storage.resize(static_cast<std::size_t>(vocab * p.ld_weight * bytes + 1));
  p.bias_storage.resize(static_cast<std::size_t>(vocab * bytes + 1));
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> h(0.0f, std), w(0.0f, 1.0f / std::sqrt(static_cast<float>(hidden))), b(0.0f, 0.5f);
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t k = 0; k < hidden; ++k) p.set_hidden(i, k, h(gen));
  }
  for (int64_t v = 0; v < vocab; ++v) {
    for (int64_t k = 0; k < hidden; ++k) {
      detail::narrow(w(gen), p.weight_storage.data() + (v * p.ld_weight + k) * bytes, dtype);
    }
    p.set_bias(v, with_bias ? b(gen) : 0.0f);
  }
  std::uniform_int_distribution<int64_t> t(0, vocab - 1);
  std::uniform_real_distribution<float> g(0.5f, 2.0f);
  for (int64_t i = 0; i < tokens; ++i) {
    p.targets.push_back(i % 7 == 3 ? -100 : t(gen));
    p.grad_loss.push_back(g(gen));
  }
  return p;
}

HeadOracle head_oracle(const HeadProblem& p, const LossOptions& options, float grad_scalar, bool bf16_logit_gradients,
                       const VocabShard* legacy_shard, bool round_logits) {
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  std::vector<double> hidden(static_cast<std::size_t>(n * h)), weight(static_cast<std::size_t>(v * h)), bias;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < h; ++k) hidden[static_cast<std::size_t>(i * h + k)] = p.hidden_at(i, k);
  }
  for (int64_t c = 0; c < v; ++c) {
    for (int64_t k = 0; k < h; ++k) weight[static_cast<std::size_t>(c * h + k)] = p.weight_at(c, k);
    bias.push_back(p.bias_at(c));
  }
  const std::vector<double> grad_loss = options.reduction == Reduction::kNone
                                            ? widen(p.grad_loss)
                                            : std::vector<double>{static_cast<double>(grad_scalar)};
  reference::Options o = reference_options(options);
  if (legacy_shard != nullptr) {
    o.smoothing_begin = legacy_shard->vocab_begin;
    o.smoothing_end = legacy_shard->vocab_end;
  }
  const int logit_bits = !round_logits || p.dtype == kFloat32 ? 0 : p.dtype == kBFloat16 ? 8 : 11;
  return reference::linear_cross_entropy(hidden, weight, bias, n, h, v, p.targets, widen(p.weights), grad_loss, o,
                                         bf16_logit_gradients, logit_bits);
}

namespace {

double read(const std::vector<std::byte>& buffer, int64_t i, DataType dtype) {
  return detail::widen(buffer.data() + i * dtype.bytes(), dtype);
}

}  // namespace

HeadResult run_head(HeadProblem& p, const HeadRun& run) {
  const int64_t n = p.tokens, h = p.hidden;
  const std::vector<int64_t> sizes = run.sizes.empty() ? even_splits(p.vocab, run.ranks) : run.sizes;
  const std::vector<VocabShard> shards = shards_from_sizes(sizes);
  HeadResult out;
  out.loss_of_rank.resize(static_cast<std::size_t>(run.ranks));
  out.hidden_parts.resize(static_cast<std::size_t>(run.ranks));
  out.grad_hidden.assign(static_cast<std::size_t>(n * h), 0.0);
  out.grad_weight.assign(static_cast<std::size_t>(p.vocab * h), 0.0);
  out.grad_bias.assign(static_cast<std::size_t>(p.vocab), 0.0);
  std::mutex mu;
  const DataType gd = run.accumulate ? kFloat32 : run.grad_dtype;
  const int64_t loss_n = run.loss.reduction == Reduction::kNone ? n : 1;
  std::vector<int64_t> targets = p.targets;
  auto rank_body = [&](Communicator& comm) -> Status {
    const int r = comm.rank();
    const VocabShard& shard = shards[static_cast<std::size_t>(r)];
    const int64_t vr = shard.vocab_end - shard.vocab_begin;
    TensorView bias = p.bias_view(shard.vocab_begin, shard.vocab_end);
    HeadInputs in{p.hidden_view(), p.weight_view(shard.vocab_begin, shard.vocab_end), p.with_bias ? &bias : nullptr};
    const TensorView tv = TensorView::contiguous(targets.data(), kInt64, {n});
    std::vector<float> loss(static_cast<std::size_t>(loss_n), NAN);
    std::vector<double> lse64(static_cast<std::size_t>(n), NAN);
    std::vector<float> lse32(static_cast<std::size_t>(n), NAN);
    const TensorView loss_v = TensorView::contiguous(loss.data(), kFloat32, {loss_n});
    const TensorView lse_v = run.lse_dtype == kFloat32 ? TensorView::contiguous(lse32.data(), kFloat32, {n})
                                                       : TensorView::contiguous(lse64.data(), run.lse_dtype, {n});
    std::vector<std::byte> gh(static_cast<std::size_t>(n * h * gd.bytes())),
        gw(static_cast<std::size_t>(vr * h * gd.bytes())), gb(static_cast<std::size_t>(vr * gd.bytes()));
    for (int64_t i = 0; i < n * h; ++i)
      detail::narrow(run.accumulate ? run.prefill : NAN, gh.data() + i * gd.bytes(), gd);
    for (int64_t i = 0; i < vr * h; ++i)
      detail::narrow(run.accumulate ? run.prefill : NAN, gw.data() + i * gd.bytes(), gd);
    for (int64_t i = 0; i < vr; ++i) detail::narrow(run.accumulate ? run.prefill : NAN, gb.data() + i * gd.bytes(), gd);
    const TensorView ghv = TensorView::contiguous(gh.data(), gd, {n, h});
    const TensorView gwv = TensorView::contiguous(gw.data(), gd, {vr, h});
    TensorView gbv = TensorView::contiguous(gb.data(), gd, {vr});
    if (vr == 0) {  // as PyTorch gives empty tensors: no memory at all
      bias.data = nullptr;
      gbv.data = nullptr;
    }
    HeadGradients grads{{&ghv, run.accumulate},
                        {&gwv, run.accumulate},
                        {p.with_bias && run.want_bias ? &gbv : nullptr, run.accumulate}};
    std::vector<float> weights = p.weights;
    const TensorView wv = TensorView::contiguous(weights.data(), kFloat32, {n});
    ForwardExtras extras;
    if (!weights.empty()) extras.weights = &wv;
    int64_t collectives = -1;
    Workspace* ws = run.workspaces != nullptr ? &(*run.workspaces)[static_cast<std::size_t>(r)] : nullptr;
    Status s;
    if (run.mode == Mode::kRecompute) {
      s = linear_cross_entropy_forward(comm, in, tv, shard, run.loss, run.head, loss_v, lse_v, extras, ws);
      if (!s.ok()) return s;
      std::vector<float> gl =
          run.loss.reduction == Reduction::kNone ? p.grad_loss : std::vector<float>{run.grad_scalar};
      const TensorView glv = TensorView::contiguous(gl.data(), kFloat32, {static_cast<int64_t>(gl.size())});
      s = linear_cross_entropy_backward(in, tv, lse_v, glv, shard, run.loss, run.head, grads, extras.weights, ws);
    } else {
      s = linear_cross_entropy_forward_backward(comm, in, tv, shard, run.loss, run.head, run.grad_scalar, loss_v, lse_v,
                                                grads, extras, ws, &collectives);
    }
    if (!s.ok()) return s;
    if (run.reduce_hidden) {
      s = all_reduce_hidden_gradient(comm, ghv);
      if (!s.ok()) return s;
    }
    std::lock_guard<std::mutex> lock(mu);
    out.loss_of_rank[static_cast<std::size_t>(r)] = loss;
    if (r == 0) {
      out.loss = loss;
      out.lse = run.lse_dtype == kFloat32 ? std::vector<double>(lse32.begin(), lse32.end()) : lse64;
      out.collectives = collectives;
    }
    auto& part = out.hidden_parts[static_cast<std::size_t>(r)];
    for (int64_t i = 0; i < n * h; ++i) {
      part.push_back(static_cast<float>(read(gh, i, gd)));
      if (run.reduce_hidden) {
        if (r == 0) out.grad_hidden[static_cast<std::size_t>(i)] = read(gh, i, gd);
      } else {
        out.grad_hidden[static_cast<std::size_t>(i)] += read(gh, i, gd) - (run.accumulate ? run.prefill : 0.0);
      }
    }
    for (int64_t i = 0; i < vr * h; ++i)
      out.grad_weight[static_cast<std::size_t>(shard.vocab_begin * h + i)] = read(gw, i, gd);
    for (int64_t i = 0; i < vr; ++i) out.grad_bias[static_cast<std::size_t>(shard.vocab_begin + i)] = read(gb, i, gd);
    return {};
  };
  if (run.on_calling_thread && run.ranks == 1) {
    Loopback solo;
    out.status = {rank_body(solo)};
  } else {
    std::unique_ptr<ThreadGroup> group;
    EXPECT_TRUE(ThreadGroup::create(run.ranks, &group).ok());
    out.status = group->run(rank_body);
  }
  if (run.accumulate) {
    for (double& x : out.grad_weight) x -= run.prefill;
    for (double& x : out.grad_bias) x -= run.prefill;
    if (run.reduce_hidden) {
      for (double& x : out.grad_hidden) x -= run.ranks * static_cast<double>(run.prefill);
    }
  }
  return out;
}

void expect_ok(const HeadResult& r) {
  for (std::size_t k = 0; k < r.status.size(); ++k)
    ASSERT_TRUE(r.status[k].ok()) << "rank " << k << ": " << r.status[k].message();
}

void expect_matches(const HeadProblem& p, const HeadRun& run, const HeadResult& r, double loss_tol, double grad_tol) {
  expect_ok(r);
  const HeadOracle o = head_oracle(p, run.loss, run.grad_scalar);
  EXPECT_LE(relative_error(widen(r.loss), o.loss.loss), loss_tol);
  EXPECT_LE(relative_error(widen(r.lse), o.loss.lse), loss_tol);
  EXPECT_LE(relative_error(r.grad_hidden, o.grad_hidden), grad_tol);
  EXPECT_LE(relative_error(r.grad_weight, o.grad_weight), grad_tol);
  if (p.with_bias && run.want_bias) EXPECT_LE(relative_error(r.grad_bias, o.grad_bias), grad_tol);
  for (const auto& l : r.loss_of_rank) {  // every rank the same bits
    ASSERT_EQ(l.size(), r.loss.size());
    EXPECT_EQ(std::memcmp(l.data(), r.loss.data(), l.size() * sizeof(float)), 0);
  }
}

}  // namespace vpce::test
