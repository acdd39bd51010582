// tests/simd_targets_test.cc: every SIMD target that Highway compiled and this CPU runs
// (AVX-512, AVX2, SSE4, SSSE3, scalar on x86; AVX-512 also without AVX512-BF16's
// instructions on a CPU that has them), forced one at a time, against the fp64
// oracle: all dtypes, in place and not, every transform, extras, rows longer than a block
// (so blocks are folded), and a single long row (so blocks are split across threads); and the
// gradients' stores, which round fp32 to fp16 and bf16, against the exact scalar conversions.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <bit>
#include <cmath>
#include <string>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"
#include "support.h"

namespace vpce::test {
namespace {

double unit_roundoff(DataType d) { return d == kFloat32 ? 0x1p-24 : d == kBFloat16 ? 0x1p-8 : 0x1p-11; }

struct TargetCase {
  DataType dtype;
  int64_t tokens, vocab;
  int ranks;
  bool in_place;
  float softcap, scale, smoothing;
  bool extras;
};

void check_case(const TargetCase& c, const std::string& target) {
  Problem problem = random_problem(c.tokens, c.vocab, c.dtype, static_cast<uint64_t>(c.vocab + c.tokens));
  RunOptions options;
  options.loss.softcap = c.softcap;
  options.loss.logit_scale = c.scale;
  options.loss.label_smoothing = c.smoothing;
  options.loss.num_threads = 2;
  options.in_place = c.in_place;
  options.extras = c.extras;
  const Problem before = problem;
  const RunResult result = run_ranks(problem, shards_from_sizes(even_splits(c.vocab, c.ranks)), options);
  for (const Status& s : result.status) ASSERT_TRUE(s.ok()) << s.to_string();
  const reference::Result want = oracle(before, options);
  const std::string where = target + " " + to_string(c.dtype) + " N" + std::to_string(c.tokens) + " V" +
                            std::to_string(c.vocab) + (c.in_place ? " in place" : "");
  EXPECT_LE(relative_error(widen(result.per_rank[0].loss), want.loss), 1e-6) << where;
  EXPECT_LE(relative_error(widen(result.per_rank[0].lse), want.lse), 1e-6) << where;
  // An in-place low-precision gradient is rounded once more to its dtype.
  const double grad_tolerance = c.in_place ? unit_roundoff(c.dtype) + 1e-6 : 1e-6;
  EXPECT_LE(relative_error(result.grad, want.grad), grad_tolerance) << where;
  if (c.extras) EXPECT_LE(relative_error(widen(result.per_rank[0].entropy), want.entropy), 1e-6) << where;
}

TEST(SimdTargets, EveryTargetMatchesTheOracle) {
  std::vector<std::string> ran;
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    const std::string& name = variant.name;
    ran.push_back(name);
    for (DataType dtype : {kFloat32, kBFloat16, kFloat16}) {
      for (bool in_place : {false, true}) {
        check_case({dtype, 7, 1003, 3, in_place, 0.0f, 1.0f, 0.1f, true}, name);
        check_case({dtype, 5, 40000, 2, in_place, 0.0f, 1.0f, 0.0f, false}, name);  // 2 blocks per rank
        check_case({dtype, 1, 70001, 1, in_place, 6.0f, 0.8f, 0.1f, true}, name);   // one row, split
        check_case({dtype, 3, 77, 4, in_place, 3.0f, 1.5f, 0.0f, true}, name);      // tails only
      }
    }
  }
  use_best_simd_variant();
  const std::string list = [&] {
    std::string s;
    for (const std::string& n : ran) s += n + ", ";
    return s;
  }();
  RecordProperty("targets", list);
  std::printf("SIMD targets tested: %s\n", list.c_str());
  EXPECT_NE(std::find(ran.begin(), ran.end(), "SCALAR"), ran.end()) << list;
#if defined(__x86_64__)
  if (hwy::SupportedTargets() & HWY_AVX2) EXPECT_NE(std::find(ran.begin(), ran.end(), "AVX2"), ran.end()) << list;
  if (hwy::SupportedTargets() & HWY_AVX3) EXPECT_NE(std::find(ran.begin(), ran.end(), "AVX3"), ran.end()) << list;
  if ((hwy::SupportedTargets() & HWY_AVX3) && detail::cpu_has_avx512_bf16()) {
    EXPECT_NE(std::find(ran.begin(), ran.end(), "AVX3 without AVX512-BF16"), ran.end()) << list;
  }
#endif
}

// Every finite value of the 16-bit type T from 0 up, the midpoints between neighbours (ties,
// which round to even), the fp32 values on either side of each midpoint, and their negatives;
// then zeros, infinities, NaN, and values beyond both ends of T's range.
template <class T>
std::vector<float> rounding_cases() {
  std::vector<float> x;
  const auto largest = static_cast<uint16_t>(std::is_same_v<T, detail::Float16> ? 0x7BFF : 0x7F7F);
  for (uint32_t bits = 0; bits <= largest; ++bits) {
    const float lo = detail::to_float(T{static_cast<uint16_t>(bits)});
    const float hi = detail::to_float(T{static_cast<uint16_t>(bits + 1)});
    const float mid =
        std::isinf(hi) ? lo + (lo - detail::to_float(T{static_cast<uint16_t>(bits - 1)})) / 2 : (lo + hi) / 2;
    for (float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, HUGE_VALF)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  }
  for (float v : {0.0f, HUGE_VALF, std::nanf(""), 1e38f, 1e-38f, 1e-45f, 7e4f}) {
    x.push_back(v);
    x.push_back(-v);
  }
  x.push_back(1.0f);  // an odd count: the last vector is a partial one
  return x;
}

// fp16 on every target (the exact conversion; AVX-512 converts into memory, AVX2 through a
// register, the others in scalar code); bf16 too, where AVX512-BF16's instructions flush fp32
// subnormals to zero (their only difference from the scalar rounding, which is not checked
// for them there).
TEST(SimdTargets, GradientStoresRoundLikeTheScalarConversions) {
  const std::vector<float> half_cases = rounding_cases<detail::Float16>();
  const std::vector<float> bf16_cases = rounding_cases<detail::BFloat16>();
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    const bool flushes = variant.name == "AVX3" && detail::cpu_has_avx512_bf16();
    auto check = [&](const std::vector<float>& x, auto zero, detail::StorageType type) {
      using T = decltype(zero);
      std::vector<T> got(x.size());
      detail::store_lanes(x.data(), type, got.data(), static_cast<int64_t>(x.size()));
      int64_t wrong = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        if (std::isnan(x[i])) {
          wrong += !std::isnan(detail::to_float(got[i]));
        } else if (!(flushes && std::fabs(x[i]) < 0x1p-126f && x[i] != 0.0f)) {
          const uint16_t want = detail::from_float<T>(x[i]).bits;
          if (got[i].bits != want && wrong++ < 5) {
            ADD_FAILURE() << variant.name << ": " << x[i] << " (0x" << std::hex << std::bit_cast<uint32_t>(x[i])
                          << ") stored as 0x" << got[i].bits << ", want 0x" << want;
          }
        }
      }
      EXPECT_EQ(wrong, 0) << variant.name << ", " << (type == detail::StorageType::kFloat16 ? "fp16" : "bf16");
    };
    check(half_cases, detail::Float16{}, detail::StorageType::kFloat16);
    check(bf16_cases, detail::BFloat16{}, detail::StorageType::kBFloat16);
    // The in-place bf16 gradient's pair stores (rounding in integers on every target) round a
    // value exactly halfway between two bf16 away from zero at even positions and towards it
    // at odd ones (rounding_cases puts each value at an even position and its negation at the
    // odd one after it), so that ties do not lean one way; all the others to nearest even,
    // zeros and subnormals included.
    const std::vector<float>& pairs_cases = bf16_cases;
    std::vector<detail::BFloat16> got(pairs_cases.size());
    detail::store_bf16_pairs(pairs_cases.data(), reinterpret_cast<uint16_t*>(got.data()),
                             static_cast<int64_t>(got.size()));
    // Below in_pairs, every element goes through the pair stores on every target (2 x lanes
    // divides 32); after it, some do, the others through StorePartial (to nearest even).
    const size_t in_pairs = pairs_cases.size() - pairs_cases.size() % 32;
    int64_t wrong = 0, ties = 0;
    for (size_t i = 0; i < pairs_cases.size(); ++i) {
      const float x = pairs_cases[i];
      if (std::isnan(x)) {
        wrong += !std::isnan(detail::to_float(got[i]));
      } else {
        uint16_t want = detail::from_float<detail::BFloat16>(x).bits;
        const auto bits = std::bit_cast<uint32_t>(x);
        const uint16_t nearest_even = want;
        if ((bits & 0xFFFFu) == 0x8000u) {
          ties += i < in_pairs;
          want = static_cast<uint16_t>((bits >> 16) + (i % 2 == 0 ? 1 : 0));  // the larger magnitude, or the smaller
        }
        const bool either = i >= in_pairs && got[i].bits == nearest_even;
        if (got[i].bits != want && !either && wrong++ < 5) {
          ADD_FAILURE() << variant.name << ", pairs: " << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x)
                        << ") stored as 0x" << got[i].bits << ", want 0x" << want;
        }
      }
    }
    EXPECT_EQ(wrong, 0) << variant.name << ", bf16 pairs";
    EXPECT_GT(ties, 60000) << "the cases hold every bf16 midpoint";
  }
  use_best_simd_variant();
}

// A long row with few tokens is split over threads by blocks: the same bits as one thread.
TEST(SimdTargets, SplitRowsMatchOneThreadBitwise) {
  for (int64_t tokens : {1, 2}) {
    std::vector<RunResult> results;
    for (int threads : {1, 2, 5}) {
      Problem problem = random_problem(tokens, 100000, kBFloat16, 8);
      RunOptions options;
      options.loss.num_threads = threads;
      options.loss.label_smoothing = 0.1f;
      options.extras = true;
      results.push_back(run_ranks(problem, shards_from_sizes({100000}), options));
    }
    for (const RunResult& r : results) {
      EXPECT_EQ(r.per_rank[0].loss, results[0].per_rank[0].loss);
      EXPECT_EQ(r.per_rank[0].entropy, results[0].per_rank[0].entropy);
      EXPECT_EQ(r.grad, results[0].grad);
    }
  }
}

}  // namespace
}  // namespace vpce::test
