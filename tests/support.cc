// tests/support.cc: shared test helpers (see support.h).
#include "support.h"

#include <cmath>
#include <cstring>
#include <limits>

#include <hwy/targets.h>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"

namespace vpce::test {

std::vector<int64_t> even_splits(int64_t vocab, int ranks) {
  std::vector<int64_t> sizes;
  for (int r = 0; r < ranks; ++r) sizes.push_back(vocab / ranks + (r < vocab % ranks ? 1 : 0));
  return sizes;
}

std::vector<VocabShard> shards_from_sizes(const std::vector<int64_t>& sizes) {
  int64_t vocab = 0;
  for (int64_t s : sizes) vocab += s;
  std::vector<VocabShard> shards;
  int64_t begin = 0;
  for (int64_t s : sizes) {
    shards.push_back({begin, begin + s, vocab});
    begin += s;
  }
  return shards;
}

double Problem::at(int64_t i, int64_t v) const {
  return detail::widen(storage.data() + offset_bytes + (i * ld + v) * dtype.bytes(), dtype);
}

void Problem::set(int64_t i, int64_t v, float value) {
  detail::narrow(value, storage.data() + offset_bytes + (i * ld + v) * dtype.bytes(), dtype);
}

std::vector<double> Problem::as_double() const {
  std::vector<double> out(static_cast<std::size_t>(tokens * vocab));
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t v = 0; v < vocab; ++v) out[static_cast<std::size_t>(i * vocab + v)] = at(i, v);
  }
  return out;
}

TensorView Problem::shard_view(const VocabShard& shard) {
  return TensorView::matrix(base() + shard.vocab_begin * dtype.bytes(), dtype, tokens,
                            shard.vocab_end - shard.vocab_begin, ld);
}

Problem nan_span_problem(int64_t vocab, int64_t nan_begin, int64_t nan_end, bool minus_inf, DataType dtype,
                         float stddev) {
  Problem p = random_problem(2, vocab, dtype, 43, stddev);
  p.targets = {0, 1};
  for (int64_t v = nan_begin; v < nan_end; ++v) p.set(0, v, std::numeric_limits<float>::quiet_NaN());
  if (minus_inf) {
    for (int64_t v = vocab / 2; v < nan_begin; ++v) p.set(0, v, -std::numeric_limits<float>::infinity());
  }
  return p;
}

Problem random_problem(int64_t tokens, int64_t vocab, DataType dtype, uint64_t seed, float stddev) {
  Problem p;
  p.tokens = tokens;
  p.vocab = vocab;
  p.ld = vocab + 3;
  p.dtype = dtype;
  p.offset_bytes = static_cast<std::size_t>(dtype.bytes());
  p.storage.resize(static_cast<std::size_t>((tokens * p.ld + 1) * dtype.bytes()) + 64);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::uniform_int_distribution<int64_t> target(0, vocab - 1);
  std::uniform_real_distribution<float> upstream(0.5f, 2.0f);
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t v = 0; v < p.ld; ++v) p.set(i, v, v < vocab ? normal(rng) : 1e30f);  // padding
    p.targets.push_back(target(rng));
    p.grad_loss.push_back(upstream(rng));
  }
  return p;
}

namespace {

double grad_element(const std::vector<std::byte>& buffer, DataType dtype, std::size_t index) {
  return detail::widen(buffer.data() + index * static_cast<std::size_t>(dtype.bytes()), dtype);
}

Status staged_forward(Communicator& comm, const TensorView& x, const TensorView& y, const VocabShard& shard,
                      const LossOptions& options, const ForwardExtras& extras, const TensorView& loss,
                      const TensorView& lse) {
  const int64_t n = x.shape[0];
  const int ranks = comm.size();
  const bool with_extras = extras.entropy != nullptr || extras.target_is_argmax != nullptr;
  const int64_t width = with_extras ? kStatsWidthWithExtras : kStatsWidth;
  std::vector<float> mine(static_cast<std::size_t>(n * width));
  if (Status s = calculate_local_stats(x, y, shard, options, TensorView::contiguous(mine.data(), kFloat32, {n, width}));
      !s.ok()) {
    return s;
  }
  std::vector<float> all(static_cast<std::size_t>(ranks * n * width));
  if (Status s = comm.all_gather(mine.data(), all.data(), mine.size() * sizeof(float)); !s.ok()) return s;
  // Every rank's shard, as a framework knows them (the merge rebases each rank's sum of
  // logits by its column count).
  std::vector<VocabShard> shards(static_cast<std::size_t>(ranks));
  if (Status s = comm.all_gather(&shard, shards.data(), sizeof(VocabShard)); !s.ok()) return s;
  std::vector<float> merged(static_cast<std::size_t>(n * width));
  const TensorView merged_view = TensorView::contiguous(merged.data(), kFloat32, {n, width});
  if (Status s =
          merge_stats(TensorView::contiguous(all.data(), kFloat32, {ranks, n, width}), options, merged_view, shards);
      !s.ok()) {
    return s;
  }
  return calculate_loss(merged_view, y, shard.vocab_size, options, loss, lse, extras);
}

}  // namespace

RunResult empty_result(int ranks, int64_t n, bool reduced) {
  RunResult result;
  result.per_rank.resize(static_cast<std::size_t>(ranks));
  for (RankOutputs& o : result.per_rank) {
    o.loss.assign(reduced ? 1 : static_cast<std::size_t>(n), std::nanf(""));
    o.lse.assign(static_cast<std::size_t>(n), std::nanf(""));
    o.target_is_argmax.assign(static_cast<std::size_t>(n), std::nanf(""));
    o.entropy.assign(static_cast<std::size_t>(n), std::nanf(""));
  }
  return result;
}

Status Loopback::all_gather(const void* send, void* recv, std::size_t bytes) {
  if (bytes > 0) std::memcpy(recv, send, bytes);
  return {};
}

Status run_rank(Communicator& comm, Problem& problem, const VocabShard& shard, const RunOptions& options,
                RankOutputs* mine, std::byte* grad) {
  const int64_t n = problem.tokens;
  const bool reduced = options.loss.reduction != Reduction::kNone;
  const DataType grad_dtype = options.in_place ? problem.dtype : options.grad_dtype;
  const TensorView weights = TensorView::contiguous(const_cast<float*>(options.weights.data()), kFloat32, {n});
  const TensorView* weights_view = options.weights.empty() ? nullptr : &weights;
  const TensorView x = problem.shard_view(shard);
  const TensorView y = TensorView::contiguous(problem.targets.data(), kInt64, {n});
  const TensorView loss =
      TensorView::contiguous(mine->loss.data(), kFloat32, {static_cast<int64_t>(mine->loss.size())});
  // An fp32 lse goes through its own buffer, widened into mine->lse at the end.
  std::vector<float> lse32(options.lse_dtype == kFloat32 ? static_cast<std::size_t>(n) : 0, std::nanf(""));
  struct Widen {
    const std::vector<float>& from;
    std::vector<double>& to;
    ~Widen() {
      for (std::size_t i = 0; i < from.size(); ++i) to[i] = static_cast<double>(from[i]);
    }
  } widen_at_return{lse32, mine->lse};
  const TensorView lse = options.lse_dtype == kFloat32
                             ? TensorView::contiguous(lse32.data(), kFloat32, {n})
                             : TensorView::contiguous(mine->lse.data(), options.lse_dtype, {n});
  const TensorView argmax = TensorView::contiguous(mine->target_is_argmax.data(), kFloat32, {n});
  const TensorView entropy = TensorView::contiguous(mine->entropy.data(), kFloat32, {n});
  ForwardExtras extras;
  extras.weights = weights_view;
  if (options.extras) {
    extras.target_is_argmax = &argmax;
    extras.entropy = &entropy;
  }
  Workspace workspace;
  const Status forwarded = options.staged ? staged_forward(comm, x, y, shard, options.loss, extras, loss, lse)
                                          : forward(comm, x, y, shard, options.loss, loss, lse, extras, &workspace);
  if (!forwarded.ok()) return forwarded;
  const TensorView g = reduced ? TensorView::contiguous(const_cast<float*>(&options.grad_scalar), kFloat32, {1})
                               : TensorView::contiguous(problem.grad_loss.data(), kFloat32, {n});
  const int64_t cols = shard.vocab_end - shard.vocab_begin;
  const TensorView out = options.in_place ? x
                                          : TensorView::matrix(grad + shard.vocab_begin * grad_dtype.bytes(),
                                                               grad_dtype, n, cols, problem.vocab);
  return options.staged ? calculate_gradients(x, y, lse, g, shard, options.loss, out, weights_view)
                        : backward(x, y, lse, g, shard, options.loss, out, weights_view);
}

std::vector<std::byte> grad_buffer(const Problem& problem, const RunOptions& options) {
  const DataType grad_dtype = options.in_place ? problem.dtype : options.grad_dtype;
  return std::vector<std::byte>(static_cast<std::size_t>(problem.tokens * problem.vocab * grad_dtype.bytes()) + 8);
}

std::vector<double> gathered_grad(const Problem& problem, const RunOptions& options,
                                  const std::vector<std::byte>& grad) {
  const DataType grad_dtype = options.in_place ? problem.dtype : options.grad_dtype;
  std::vector<double> out(static_cast<std::size_t>(problem.tokens * problem.vocab));
  for (int64_t i = 0; i < problem.tokens; ++i) {
    for (int64_t v = 0; v < problem.vocab; ++v) {
      const auto index = static_cast<std::size_t>(i * problem.vocab + v);
      out[index] = options.in_place ? problem.at(i, v) : grad_element(grad, grad_dtype, index);
    }
  }
  return out;
}

RunResult run_ranks(Problem& problem, const std::vector<VocabShard>& shards, const RunOptions& options) {
  const int ranks = static_cast<int>(shards.size());
  RunResult result = empty_result(ranks, problem.tokens, options.loss.reduction != Reduction::kNone);
  std::vector<std::byte> grad = grad_buffer(problem, options);
  std::unique_ptr<ThreadGroup> group;
  if (Status s = ThreadGroup::create(ranks, &group); !s.ok()) {
    result.status.assign(static_cast<std::size_t>(ranks), s);
    return result;
  }
  result.status = group->run([&](Communicator& comm) -> Status {
    const auto r = static_cast<std::size_t>(comm.rank());
    return run_rank(comm, problem, shards[r], options, &result.per_rank[r], grad.data());
  });
  result.grad = gathered_grad(problem, options, grad);
  return result;
}

reference::Options reference_options(const LossOptions& l) {
  reference::Options o;
  o.label_smoothing = l.label_smoothing;
  o.pytorch_smoothing = l.smoothing_semantics == SmoothingSemantics::kPyTorch;
  o.ignore_index = l.ignore_index;
  o.z_loss = l.z_loss_weight;
  o.logit_scale = l.logit_scale;
  o.softcap = l.softcap;
  o.valid_vocab = l.valid_vocab_size;
  o.reduction = l.reduction == Reduction::kNone  ? reference::Reduction::kNone
                : l.reduction == Reduction::kSum ? reference::Reduction::kSum
                                                 : reference::Reduction::kMean;
  return o;
}

reference::Result oracle(const Problem& problem, const RunOptions& options) {
  const LossOptions& l = options.loss;
  const reference::Options o = reference_options(l);
  const std::vector<double> grad_loss = l.reduction == Reduction::kNone
                                            ? widen(problem.grad_loss)
                                            : std::vector<double>{static_cast<double>(options.grad_scalar)};
  return reference::cross_entropy(problem.as_double(), problem.tokens, problem.vocab, problem.targets,
                                  widen(options.weights), grad_loss, o);
}

double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0.0;
  double scale = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    worst = std::isnan(d) ? HUGE_VAL : std::max(worst, d);
    scale = std::max(scale, std::fabs(b[i]));
  }
  return scale > 0.0 ? worst / scale : worst;
}

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

std::vector<SimdVariant> simd_variants() {
  std::vector<SimdVariant> variants;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    variants.push_back({target, true, hwy::TargetName(target)});
#if HWY_ARCH_X86
    if (target == HWY_AVX3 && detail::cpu_has_avx512_bf16()) {
      variants.push_back({target, false, std::string(hwy::TargetName(target)) + " without AVX512-BF16"});
    }
#endif
  }
  return variants;
}

void use_simd_variant(const SimdVariant& variant) {
  hwy::SetSupportedTargetsForTest(variant.target);
  detail::set_bf16_instructions_allowed(variant.bf16_instructions);
}

void use_best_simd_variant() {
  hwy::SetSupportedTargetsForTest(0);
  detail::set_bf16_instructions_allowed(true);
}

}  // namespace vpce::test
