// tests/differential/differential.cc: drawing a case, running it, comparing it with the
// oracle (see differential.h).
#include "differential.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "support.h"

namespace vpce::test {

uint64_t Choices::word() {
  if (data_ == nullptr) return rng_();
  uint64_t w = 0;
  for (int b = 0; b < 8; ++b) w = (w << 8) | (size_ > 0 ? (--size_, *data_++) : 0u);
  return w;
}

uint64_t Choices::below(uint64_t bound) { return bound <= 1 ? 0 : word() % bound; }
double Choices::unit() { return static_cast<double>(word() >> 11) * 0x1p-53; }

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kFloatEpsilon = 0x1p-24;

double unit_roundoff(DataType d) { return d == kFloat32 ? 0x1p-24 : d == kBFloat16 ? 0x1p-8 : 0x1p-11; }

struct Case {
  Problem problem;
  std::vector<VocabShard> shards;
  RunOptions options;
  std::ostringstream description;
};

std::vector<int64_t> drawn_splits(Choices& c, int64_t vocab, int ranks) {
  std::vector<int64_t> cuts{0, vocab};
  while (static_cast<int>(cuts.size()) < ranks + 1) {  // ranks <= vocab: a free cut exists
    auto cut = static_cast<int64_t>(1 + c.below(static_cast<uint64_t>(vocab - 1)));
    // Taken (a fuzzer's input may have run out, so every choice is 0): the next free one.
    while (std::find(cuts.begin(), cuts.end(), cut) != cuts.end()) cut = 1 + cut % (vocab - 1);
    cuts.push_back(cut);
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<int64_t> sizes;
  for (std::size_t r = 0; r + 1 < cuts.size(); ++r) sizes.push_back(cuts[r + 1] - cuts[r]);
  return sizes;
}

float drawn_non_finite(Choices& c) {
  const uint64_t k = c.below(20);
  return k < 10 ? std::numeric_limits<float>::quiet_NaN() : k < 17 ? -kInf : kInf;
}

// Non-finite values in some rows: singly (often on a shard's edge or the target), as a
// vector of 8, 16 or 32, a chunk of 1024, a rank's whole shard, or the whole row.
void inject_non_finite(Choices& c, Case& k) {
  Problem& p = k.problem;
  for (int64_t i = 0; i < p.tokens; ++i) {
    if (!c.percent(30)) continue;
    const float value = drawn_non_finite(c);
    int64_t begin = 0, end = p.vocab;
    switch (c.below(6)) {
      case 0: {  // one element
        const VocabShard& s = k.shards[c.below(k.shards.size())];
        const int64_t edges[] = {s.vocab_begin, s.vocab_end - 1, std::clamp<int64_t>(p.targets[i], 0, p.vocab - 1),
                                 static_cast<int64_t>(c.below(static_cast<uint64_t>(p.vocab)))};
        begin = edges[c.below(4)];
        end = begin + 1;
        break;
      }
      case 1: {  // a vector
        const int64_t width = int64_t{8} << c.below(3);
        begin = static_cast<int64_t>(c.below(static_cast<uint64_t>(p.vocab)));
        if (c.percent(50)) begin -= begin % width;
        end = std::min(p.vocab, begin + width);
        break;
      }
      case 2:  // a chunk
        begin = static_cast<int64_t>(c.below(static_cast<uint64_t>(p.vocab)));
        end = std::min(p.vocab, begin + 1024);
        break;
      case 3:
      case 4: {  // a shard
        const VocabShard& s = k.shards[c.below(k.shards.size())];
        begin = s.vocab_begin;
        end = s.vocab_end;
        break;
      }
      default: break;  // the row
    }
    for (int64_t v = begin; v < end; ++v) p.set(i, v, value);
    // Sometimes the rest of the row is -inf, so only the non-finite values remain.
    if (c.percent(15)) {
      for (int64_t v = 0; v < p.vocab; ++v) {
        if (v < begin || v >= end) p.set(i, v, -kInf);
      }
    }
    k.description << " row " << i << " [" << begin << ", " << end << ")=" << value;
  }
}

Case draw_case(Choices& c) {
  Case k;
  const uint64_t size_class = c.below(10);
  const int64_t vocab = size_class < 5   ? static_cast<int64_t>(1 + c.below(200))
                        : size_class < 9 ? static_cast<int64_t>(200 + c.below(4800))
                                         : static_cast<int64_t>(16385 + c.below(20000));  // several blocks a row
  const int64_t tokens = size_class == 9 ? static_cast<int64_t>(1 + c.below(4)) : static_cast<int64_t>(1 + c.below(24));
  const int ranks = static_cast<int>(std::min<int64_t>(vocab, static_cast<int64_t>(1 + c.below(4))));
  const DataType dtypes[] = {kFloat32, kBFloat16, kFloat16};
  const DataType dtype = dtypes[c.below(3)];
  const float stddevs[] = {1.0f, 3.0f, 30.0f};
  const float stddev = stddevs[c.below(3)];

  Problem& p = k.problem;
  p.tokens = tokens;
  p.vocab = vocab;
  p.ld = vocab + static_cast<int64_t>(c.below(18));
  p.dtype = dtype;
  p.offset_bytes = static_cast<std::size_t>(c.below(4)) * static_cast<std::size_t>(dtype.bytes());
  p.storage.resize(static_cast<std::size_t>((tokens * p.ld + 4) * dtype.bytes()) + 64);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::mt19937_64 values(c.below(std::numeric_limits<uint64_t>::max()));
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t v = 0; v < p.ld; ++v) p.set(i, v, v < vocab ? normal(values) : 1e30f);  // between rows: never read
  }
  if (c.percent(10)) {  // huge logits
    for (int64_t i = 0; i < tokens; ++i)
      p.set(i, static_cast<int64_t>(c.below(static_cast<uint64_t>(vocab))), c.percent(50) ? 1e4f : -1e4f);
  }
  k.shards = shards_from_sizes(c.percent(30) ? even_splits(vocab, ranks) : drawn_splits(c, vocab, ranks));

  LossOptions& o = k.options.loss;
  if (c.percent(15) && vocab > 2)
    o.valid_vocab_size =
        vocab - static_cast<int64_t>(1 + c.below(static_cast<uint64_t>(std::min<int64_t>(vocab - 2, 40))));
  const int64_t valid = o.valid_vocab_size > 0 ? o.valid_vocab_size : vocab;
  if (c.percent(30) && valid >= 2) {
    o.label_smoothing = c.percent(50) ? 0.1f : static_cast<float>(c.unit() * 0.9);
    o.smoothing_semantics = c.percent(50) ? SmoothingSemantics::kMegatron : SmoothingSemantics::kPyTorch;
  }
  if (c.percent(20)) o.z_loss_weight = static_cast<float>(1e-4 + c.unit() * 1e-2);
  if (c.percent(20)) o.logit_scale = static_cast<float>(0.5 + c.unit() * 1.5);
  if (c.percent(20)) o.softcap = static_cast<float>(5.0 + c.unit() * 45.0);
  if (c.percent(10)) o.ignore_index = -static_cast<int64_t>(1 + c.below(1000));
  const Reduction reductions[] = {Reduction::kNone, Reduction::kSum, Reduction::kMean};
  o.reduction = reductions[c.below(3)];
  o.num_threads = static_cast<int>(1 + c.below(2));
  for (int64_t i = 0; i < tokens; ++i) {
    const VocabShard& s = k.shards[c.below(k.shards.size())];
    const uint64_t kind = c.below(10);
    int64_t y = kind < 2   ? s.vocab_begin
                : kind < 4 ? s.vocab_end - 1
                           : static_cast<int64_t>(c.below(static_cast<uint64_t>(valid)));
    if (y >= valid) y = valid - 1;
    if (c.percent(8)) y = o.ignore_index;
    p.targets.push_back(y);
    p.grad_loss.push_back(static_cast<float>(0.5 + c.unit() * 1.5));
  }
  if (c.percent(25)) {
    for (int64_t i = 0; i < tokens; ++i)
      k.options.weights.push_back(c.percent(15) ? 0.0f : static_cast<float>(c.unit() * 2.0));
  }
  k.options.extras = c.percent(30);
  k.options.in_place = c.percent(30);
  k.options.staged = c.percent(20);
  if (!k.options.in_place) k.options.grad_dtype = dtypes[c.percent(70) ? 0 : c.below(3)];
  k.options.grad_scalar = static_cast<float>(0.5 + c.unit() * 1.5);

  k.description << "N " << tokens << " V " << vocab << " ld " << p.ld << " offset " << p.offset_bytes << " R " << ranks
                << " " << to_string(dtype) << " sd " << stddev << " splits";
  for (const VocabShard& s : k.shards) k.description << " " << s.vocab_end - s.vocab_begin;
  k.description << " smoothing " << o.label_smoothing
                << (o.smoothing_semantics == SmoothingSemantics::kPyTorch ? "(pt)" : "") << " z " << o.z_loss_weight
                << " scale " << o.logit_scale << " cap " << o.softcap << " valid " << o.valid_vocab_size << " ignore "
                << o.ignore_index << " reduction " << static_cast<int>(o.reduction) << " threads " << o.num_threads
                << (k.options.weights.empty() ? "" : " weights") << (k.options.extras ? " extras" : "")
                << (k.options.in_place ? " in-place" : "") << (k.options.staged ? " staged" : "") << " grad "
                << to_string(k.options.grad_dtype);
  inject_non_finite(c, k);
  return k;
}

// "" when `got` is what `want` allows: NaN for NaN, the same infinity, or within `tolerance`.
std::string compare(double got, double want, double tolerance) {
  const bool agree = std::isnan(want)   ? std::isnan(got)
                     : std::isinf(want) ? got == want
                                        : std::isfinite(got) && std::fabs(got - want) <= tolerance;
  if (agree) return "";
  std::ostringstream out;
  out.precision(9);
  out << "got " << got << ", want " << want << " (tolerance " << tolerance << ")";
  return out.str();
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(a)) == 0 || (std::isnan(a) && std::isnan(b)); }
bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof(a)) == 0 || (std::isnan(a) && std::isnan(b)); }

}  // namespace

std::string run_differential_case(Choices& choices) {
  Case k = draw_case(choices);
  const Problem before = k.problem;
  const RunResult result = run_ranks(k.problem, k.shards, k.options);
  const std::string where = " [" + k.description.str() + "]";
  for (const Status& s : result.status) {
    if (!s.ok()) return "a rank failed: " + s.to_string() + where;
  }
  const reference::Result want = oracle(before, k.options);
  const LossOptions& o = k.options.loss;
  const Problem& p = before;
  const int64_t valid = o.valid_vocab_size > 0 ? o.valid_vocab_size : p.vocab;
  const bool transformed = o.logit_scale != 1.0f || o.softcap > 0.0f;
  // Per token: the largest finite |z| of the row, which bounds the fp32 rounding of the
  // transform and of the sum of logits (smoothing).
  std::vector<double> z_max(static_cast<std::size_t>(p.tokens), 0.0);
  for (int64_t i = 0; i < p.tokens; ++i) {
    for (int64_t v = 0; v < valid; ++v) {
      const double z = std::fabs(p.at(i, v) * o.logit_scale);
      if (std::isfinite(z))
        z_max[static_cast<std::size_t>(i)] =
            std::max(z_max[static_cast<std::size_t>(i)], o.softcap > 0.0f ? std::min<double>(z, o.softcap) : z);
    }
  }
  auto loss_tolerance = [&](int64_t i, double value) {
    const double z = z_max[static_cast<std::size_t>(i)];
    return 2e-6 * std::max(1.0, std::fabs(value)) +
           (transformed || o.label_smoothing > 0.0f ? 64.0 : 0.0) * kFloatEpsilon * z;
  };
  for (std::size_t r = 0; r < result.per_rank.size(); ++r) {  // every rank: the same bits
    const RankOutputs& a = result.per_rank[0];
    const RankOutputs& b = result.per_rank[r];
    for (std::size_t i = 0; i < a.loss.size(); ++i) {
      if (!same_bits(a.loss[i], b.loss[i]))
        return "rank " + std::to_string(r) + "'s loss differs from rank 0's" + where;
    }
    for (std::size_t i = 0; i < a.lse.size(); ++i) {
      if (!same_bits(a.lse[i], b.lse[i])) return "rank " + std::to_string(r) + "'s lse differs from rank 0's" + where;
    }
  }
  const RankOutputs& got = result.per_rank[0];
  for (int64_t i = 0; i < p.tokens; ++i) {
    const auto u = static_cast<std::size_t>(i);
    if (std::string e = compare(got.lse[u], want.lse[u],
                                2e-6 * std::max(1.0, std::fabs(want.lse[u])) + 4 * kFloatEpsilon * z_max[u]);
        !e.empty()) {
      return "lse of token " + std::to_string(i) + ": " + e + where;
    }
    if (o.reduction == Reduction::kNone) {
      if (std::string e = compare(got.loss[u], want.loss[u], loss_tolerance(i, want.loss[u])); !e.empty()) {
        return "loss of token " + std::to_string(i) + ": " + e + where;
      }
    }
    if (k.options.extras) {
      if (std::string e = compare(got.entropy[u], want.entropy[u],
                                  1e-5 * std::max(1.0, std::fabs(want.entropy[u])) + 64 * kFloatEpsilon * z_max[u]);
          !e.empty()) {
        return "entropy of token " + std::to_string(i) + ": " + e + where;
      }
      // The argmax where it is well defined: no NaN, and a gap above the rounding.
      const double gap = want.top_gap[u];
      if (!std::isnan(want.lse[u]) && gap > 1e-3 * std::max(1.0, z_max[u]) &&
          got.target_is_argmax[u] != want.target_is_argmax[u]) {
        return "target_is_argmax of token " + std::to_string(i) + ": got " + std::to_string(got.target_is_argmax[u]) +
               where;
      }
    }
  }
  if (o.reduction != Reduction::kNone) {
    double tolerance = 0.0, counted = 0.0;
    for (int64_t i = 0; i < p.tokens; ++i) {
      const double w = k.options.weights.empty() ? 1.0 : k.options.weights[static_cast<std::size_t>(i)];
      if (p.targets[static_cast<std::size_t>(i)] == o.ignore_index) continue;
      counted += w;
      const double l =
          std::isfinite(want.lse[static_cast<std::size_t>(i)]) ? std::fabs(want.lse[static_cast<std::size_t>(i)]) : 0.0;
      tolerance += w * (loss_tolerance(i, l) + 2e-6 * l);
    }
    if (o.reduction == Reduction::kMean && counted > 0.0) tolerance /= counted;
    if (std::string e = compare(got.loss[0], want.loss[0], tolerance + 1e-6 * std::fabs(want.loss[0])); !e.empty()) {
      return "reduced loss: " + e + where;
    }
  }
  // The gradient, row by row, within a bound relative to the row's unit g w (1 + 2 zl lse)
  // dz/dx (p and the target's 1 are of order one, and p - 1 cancels): the output's rounding,
  // a few fp32 roundings, the transform's (its fp32 z and tanh), and an fp32 lse's where the
  // harness keeps one (p = e^(z - lse) then carries ulp(lse)); the float64 lse adds
  // 2^-53 |lse|, below these wherever |lse| < 1e9.
  const DataType grad_dtype = k.options.in_place ? p.dtype : k.options.grad_dtype;
  double counted = 0.0;
  for (int64_t i = 0; i < p.tokens; ++i) {
    if (p.targets[static_cast<std::size_t>(i)] != o.ignore_index)
      counted += k.options.weights.empty() ? 1.0 : k.options.weights[static_cast<std::size_t>(i)];
  }
  for (int64_t i = 0; i < p.tokens; ++i) {
    const auto u = static_cast<std::size_t>(i);
    const double w = k.options.weights.empty() ? 1.0 : k.options.weights[u];
    const double g = o.reduction == Reduction::kNone  ? p.grad_loss[u]
                     : o.reduction == Reduction::kSum ? k.options.grad_scalar
                                                      : (counted > 0.0 ? k.options.grad_scalar / counted : 0.0);
    const double lse = std::isfinite(want.lse[u]) ? std::fabs(want.lse[u]) : 0.0;
    const double unit = std::fabs(g * w) * (1.0 + 2.0 * o.z_loss_weight * lse) * o.logit_scale;
    const double lse_rounding = k.options.lse_dtype == kFloat32 ? 2 * kFloatEpsilon * lse : 0x1p-52 * lse;
    const double relative = 16 * kFloatEpsilon + (grad_dtype == kFloat32 ? 0.0 : unit_roundoff(grad_dtype)) +
                            lse_rounding + (transformed ? 16 * kFloatEpsilon * z_max[u] : 0.0);
    for (int64_t v = 0; v < p.vocab; ++v) {
      const auto index = static_cast<std::size_t>(i * p.vocab + v);
      if (std::string e = compare(result.grad[index], want.grad[index], relative * unit); !e.empty()) {
        std::ostringstream row;
        row.precision(9);
        row << " (token's lse " << got.lse[u] << ", want " << want.lse[u] << "; target " << p.targets[u] << "; logit "
            << p.at(i, v) << ")";
        return "gradient of token " + std::to_string(i) + " column " + std::to_string(v) + ": " + e + row.str() + where;
      }
    }
  }
  return "";
}

}  // namespace vpce::test
