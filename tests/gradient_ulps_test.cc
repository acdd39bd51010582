// tests/gradient_ulps_test.cc: each gradient element against the fp64 oracle's gradient
// correctly rounded to the output dtype, on every SIMD target: the mean and the largest error
// in units in the last place of the output dtype (its spacing at the exact value), the
// fraction not correctly rounded, the signs of the errors, and the bias of the softmax part
// (the non-target columns' sum against the correctly rounded one's, relative). fp32, bf16 and
// fp16 logits; in place and into fp32, bf16 or fp16 buffers; logits of standard deviation 0.1
// and 3 at offsets 0, 100, +-1e4, and with negative upstream gradients; plain, label smoothing,
// z-loss, logit scale, soft cap.
// Prints a table (docs/design.md quotes it beside Megatron's figures, which
// bindings/python/tests/test_gradient_exactness.py measures against megatron-core's helpers)
// and holds every target to bars: no bias beyond 1e-6 relative in fp32 and, where the
// exponential's argument is exact (exp_argument_is_exact: AVX2, AVX-512), fp32 within 0.5 ulp
// on average (0.7 in any one case of 16 rows) and 4 at most (megatron-core: 0.59-2.8 and
// 4-20), bf16 and fp16 off their correct rounding at most 2 in 10^4 elements (1 in 10^3
// elsewhere; untransformed, without smoothing: see below).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"
#include "support.h"

namespace vpce::test {
namespace {

struct UlpStats {
  double sum_ulps = 0.0, worst_ulps = 0.0;
  int64_t count = 0, off = 0, up = 0, down = 0;
  double error_sum = 0.0, magnitude_sum = 0.0;  // of the softmax part: sum (got - cr), sum |cr|
  void add(const UlpStats& o) {
    sum_ulps += o.sum_ulps;
    worst_ulps = std::max(worst_ulps, o.worst_ulps);
    count += o.count, off += o.off, up += o.up, down += o.down;
    error_sum += o.error_sum, magnitude_sum += o.magnitude_sum;
  }
  double mean() const { return count > 0 ? sum_ulps / static_cast<double>(count) : 0.0; }
  double fraction_off() const { return count > 0 ? static_cast<double>(off) / static_cast<double>(count) : 0.0; }
  double bias() const { return magnitude_sum > 0.0 ? error_sum / magnitude_sum : 0.0; }
};

int mantissa_bits(DataType d) { return d == kFloat32 ? 23 : d == kBFloat16 ? 7 : 10; }
double smallest_normal(DataType d) { return d == kFloat16 ? 0x1p-14 : 0x1p-126; }

// x correctly rounded to `dtype` (to nearest even), as a double.
double correctly_rounded(double x, DataType dtype) {
  std::byte buffer[4];
  detail::narrow(x, buffer, dtype);
  return detail::widen(buffer, dtype);
}

// The statistics of got against the exact gradient, over the non-target columns of the
// counted tokens (the target's own element, computed apart in fp64, is always correctly
// rounded: checked too, but not part of the softmax part).
UlpStats measure(const Problem& p, const std::vector<double>& got, const std::vector<double>& exact, DataType dtype,
                 int64_t* target_off) {
  UlpStats s;
  for (int64_t i = 0; i < p.tokens; ++i) {
    for (int64_t v = 0; v < p.vocab; ++v) {
      const auto at = static_cast<std::size_t>(i * p.vocab + v);
      const double cr = correctly_rounded(exact[at], dtype);
      if (v == p.targets[static_cast<std::size_t>(i)]) {
        *target_off += got[at] != cr;
        continue;
      }
      if (exact[at] == 0.0 && got[at] == 0.0) continue;  // (a token that does not count)
      const double spacing =
          std::ldexp(1.0, std::max(std::ilogb(std::max(std::fabs(exact[at]), smallest_normal(dtype))), -1000) -
                              mantissa_bits(dtype));
      const double ulps = std::fabs(got[at] - cr) / spacing;
      s.sum_ulps += ulps;
      s.worst_ulps = std::max(s.worst_ulps, ulps);
      ++s.count;
      s.off += got[at] != cr;
      s.up += got[at] > cr;
      s.down += got[at] < cr;
      s.error_sum += got[at] - cr;

      s.magnitude_sum += std::fabs(cr);
    }
  }
  return s;
}

struct Layout {
  const char* name;
  DataType logits;
  bool in_place;
  DataType gradient;  // out of place
};

struct Input {
  const char* name;
  float stddev;
  double offset;
  float upstream_sign = 1.0f;  // -1: every upstream gradient negated (as an RL loss's can be)
};

struct Option {
  const char* name;
  LossOptions loss;
  bool transformed;  // the logit scale or the soft cap: z itself is rounded to fp32 first
};

std::vector<Option> options() {
  std::vector<Option> all;
  all.push_back({"plain", {}, false});
  LossOptions o;
  o.label_smoothing = 0.1f;
  all.push_back({"smoothing 0.1", o, false});
  o = {};
  o.z_loss_weight = 1e-4f;
  all.push_back({"z-loss 1e-4", o, false});
  o = {};
  o.logit_scale = 0.7f;
  all.push_back({"logit scale 0.7", o, true});
  o = {};
  o.softcap = 30.0f;
  all.push_back({"soft cap 30", o, true});
  return all;
}

TEST(GradientUlps, EveryElementAgainstItsCorrectRoundingOnEveryTarget) {
  const Layout layouts[] = {{"fp32 -> fp32", kFloat32, false, kFloat32},   {"fp32 in place", kFloat32, true, kFloat32},
                            {"bf16 in place", kBFloat16, true, kBFloat16}, {"bf16 -> fp32", kBFloat16, false, kFloat32},
                            {"fp16 in place", kFloat16, true, kFloat16},   {"fp32 -> bf16", kFloat32, false, kBFloat16},
                            {"fp32 -> fp16", kFloat32, false, kFloat16}};
  const Input inputs[] = {{"std 0.1", 0.1f, 0.0},      {"std 3", 3.0f, 0.0},
                          {"std 3 +100", 3.0f, 100.0}, {"std 3 +1e4", 3.0f, 1e4},
                          {"std 3 -1e4", 3.0f, -1e4},  {"std 3, upstream < 0", 3.0f, 0.0, -1.0f}};
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    const bool exact_argument = detail::exp_argument_is_exact();
    for (const Layout& layout : layouts) {
      UlpStats plain_total, untransformed_total, exact_argument_total;
      for (const Option& option : options()) {
        for (const Input& input : inputs) {
          // fp16 holds neither 1e4 + 3 sigma with its detail nor 1e4 itself once scaled.
          if ((layout.logits == kFloat16 || layout.gradient == kFloat16) && std::fabs(input.offset) > 1000.0) continue;
          Problem p =
              random_problem(16, 3001, layout.logits, 1234 + static_cast<uint64_t>(input.stddev * 10), input.stddev);
          for (int64_t i = 0; i < p.tokens; ++i) {
            for (int64_t v = 0; v < p.vocab; ++v) p.set(i, v, static_cast<float>(p.at(i, v) + input.offset));
          }
          for (float& g : p.grad_loss) g *= input.upstream_sign;
          p.targets[3] = -100;  // a token that does not count
          const Problem before = p;
          RunOptions run;
          run.loss = option.loss;
          run.in_place = layout.in_place;
          run.grad_dtype = layout.gradient;
          const RunResult result = run_ranks(p, shards_from_sizes({1500, 1501}), run);
          for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
          const reference::Result want = oracle(before, run);
          const DataType out = layout.in_place ? layout.logits : layout.gradient;
          int64_t target_off = 0;
          UlpStats s = measure(before, result.grad, want.grad, out, &target_off);
          // (the bias as a lean in magnitude: the softmax part is negative here)
          s.error_sum *= input.upstream_sign;
          const std::string where = variant.name + ", " + layout.name + ", " + option.name + ", " + input.name;
          // With a transform z = scale x (or the cap's tanh) is rounded to fp32 first, as in
          // any fp32 implementation: the oracle's exact z differs by 2^-24 |z|; reported only.
          if (option.transformed) continue;
          EXPECT_EQ(target_off, 0) << where << ": target elements not correctly rounded";
          untransformed_total.add(s);
          // With smoothing, g = p c - s / V cancels where p c is near s / V, in any fp32
          // implementation (Megatron's too): the element's error is relative to p c, not to
          // g (test_gradient_exactness.py compares it with Megatron's).
          if (option.loss.label_smoothing != 0.0f) continue;
          if (layout.logits == kFloat32 && out == kFloat32 && exact_argument) {
            EXPECT_LE(s.mean(), 0.7) << where << ": mean ulps";
            EXPECT_LE(s.worst_ulps, 4.0) << where << ": largest ulps";
            exact_argument_total.add(s);
          }
          // (1e-3 without FMA, where the argument z - max is rounded.)
          if (out != kFloat32) {
            EXPECT_LE(s.fraction_off(), exact_argument ? 2e-4 : 1e-3) << where << ": not correctly rounded";
          }
          if (option.name == std::string("plain")) plain_total.add(s);
        }
      }
      // fp32 outputs: the bias over every untransformed case (one element off by one unit
      // would be 3e-6 of a single case's sum here). bf16 and fp16 outputs: their elements
      // off by one unit, at most 2e-4 (1e-3) of them (above), bound the mean signed error by
      // that many ulps, where the weighted bias is one large element's unit or not (a
      // one-sided 1 % off, the exp of low degree this replaced, was 1e-2 ulp).
      if ((layout.in_place ? layout.logits : layout.gradient) == kFloat32) {
        EXPECT_LE(std::fabs(untransformed_total.bias()), 1e-6) << variant.name << ", " << layout.name << ": the bias";
      }
      // fp32 from fp32 logits, where the argument is exact: the mean over the plain and z-loss
      // cases (192 rows). One case's 16 rows move with their lse's rounding: over twelve other
      // seeds one case reached 0.61 (0.67 with the forward's folds summed across the lanes in
      // fp32), and the mean over the cases 0.47 at most (0.52).
      if (exact_argument_total.count > 0) {
        EXPECT_LE(exact_argument_total.mean(), 0.5) << variant.name << ", " << layout.name << ": mean ulps";
      }
      std::printf("%-26s %-14s plain: mean %.3f ulp, largest %.0f, %.5f %% off (%lld up, %lld down), bias %+.1e\n",
                  variant.name.c_str(), layout.name, plain_total.mean(), plain_total.worst_ulps,
                  100.0 * plain_total.fraction_off(), static_cast<long long>(plain_total.up),
                  static_cast<long long>(plain_total.down), plain_total.bias());
    }
  }
  use_best_simd_variant();
}

}  // namespace
}  // namespace vpce::test
