// cpu/simd_gradient.cc: a block's gradient (simd_rows.h's block_gradient), written once with
// Google Highway and compiled for every target it attains; the best one the CPU supports is
// chosen at run time. It reads each logit once and writes each gradient element once, as
// g = k e^(z - m) - u (exp-inl.h), rounded once to the gradient's dtype (vectors-inl.h).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd_gradient.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "cpu/simd/exp-inl.h"
#include "cpu/simd/transform-inl.h"
#include "cpu/simd/vectors-inl.h"

HWY_BEFORE_NAMESPACE();
namespace vpce::detail {
namespace HWY_NAMESPACE {

// The largest transformed logit of a block: the transform of the logits' max (the logit
// scale and the soft cap are increasing), -inf for none (every logit -inf, or NaN, which
// x86's MAXPS drops: such a row's lse is NaN, and so is every gradient of it). bf16 and fp16
// logits on their 16-bit patterns (RawMax16).
template <class T, int kKind>
float BlockMax(const T* row, int64_t cols, const TransformParams& t) {
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  VF max0 = neg_inf, max1 = neg_inf, max2 = neg_inf, max3 = neg_inf;
  int64_t v = 0;
  float raw_max = -std::numeric_limits<float>::infinity();
#if HWY_TARGET != HWY_SCALAR
  if constexpr (!std::is_same_v<T, float>) v = RawMax16(row, cols / (4 * lanes), &raw_max) * 4 * lanes;
#endif
  for (; v + 4 * lanes <= cols; v += 4 * lanes) {
    VF x0, x1, x2, x3;
    LoadTwo(d, row + v, x0, x1);
    LoadTwo(d, row + v + 2 * lanes, x2, x3);
    max0 = hn::Max(max0, x0);
    max1 = hn::Max(max1, x1);
    max2 = hn::Max(max2, x2);
    max3 = hn::Max(max3, x3);
  }
  for (; v + lanes <= cols; v += lanes) max0 = hn::Max(max0, LoadFull(d, row + v));
  if (v < cols) {
    const auto tail = static_cast<size_t>(cols - v);
    max1 = hn::Max(max1, hn::IfThenElse(hn::FirstN(d, tail), LoadPartial(d, row + v, tail), neg_inf));
  }
  const float lanes_max = hn::GetLane(hn::MaxOfLanes(d, hn::Max(hn::Max(max0, max1), hn::Max(max2, max3))));
  const float max = raw_max > lanes_max || std::isnan(raw_max) ? raw_max : lanes_max;
  if constexpr (kKind == kIdentity) return max;
  return hn::GetLane(Transform<kKind>(d, hn::Set(d, max), t));
}

// row: [cols] of T -> grad: [cols] of G, as g = k e^(z - m) - u with the shift m (whose
// rounding's factor is in k already).
// kHardwareBf16: full vectors of a bf16 gradient are rounded by VCVTNEPS2BF16 (AVX3 only; bf16
// logits' pairs are rounded in integers whatever the CPU: StoreBf16PairsHalfway).
// kFolded: no uniform term (u = 0), so the gradient is k e^(z - m), and k rides in the exp's
// polynomial (ExpPolynomial).
// kEntropy (not kFolded): the RL outputs' entropy term too, g = e^(z - m) (k + ke (z - mean))
// - u, z - mean as token_math.h's entropy_offset takes it from the constants `c` (E_p[z] as two
// floats, held above -2^64: 0 for a column of -inf).
// kFactorInScale (AVX3, kFolded, a shift that FactorFitsInScale): the factor's rounding
// undone in VSCALEFPS's scale rather than by an addition (ExponentialFactorInScale).
template <class T, class G, int kKind, bool kHardwareBf16, bool kFolded, bool kEntropy = false,
          bool kFactorInScale = false>
void GradientLoop(const T* row, G* grad, int64_t cols, const TransformParams& t, const LaneShift& shift, double k,
                  float u, [[maybe_unused]] double ke = 0.0, [[maybe_unused]] const GradientConstants* c = nullptr) {
  static_assert(!kEntropy || !kFolded);
  static_assert(!kFactorInScale || (kFolded && HWY_TARGET == HWY_AVX3));
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  // The shift's value and kind as locals, so that they stay in registers across the loops'
  // stores (after the fp16 store's asm the compiler would read a struct's fields again).
  const ShiftLanes lanes_shift = shift.lanes;
  const bool subtract_first = shift.subtract_first;
  const VF scaled_coefficient = hn::Set(d, static_cast<float>(k));
  const VF scaled_uniform = hn::Set(d, u);
  const VF entropy_coefficient = hn::Set(d, static_cast<float>(ke));
  const VF mean_logit_hi = hn::Set(d, kEntropy ? c->mean_logit : 0.0f);
  const VF mean_logit_lo = hn::Set(d, kEntropy ? c->mean_logit_low : 0.0f);
  const VF lowest_offset = hn::Set(d, kLowestEntropyOffset);
  // Every gradient takes the full exp, also one rounded to bf16 or fp16 afterwards: a
  // cheaper exp's error, though within one unit of the dtype, leans one way and takes a
  // rounding the wrong way a hundred times as often (docs/design.md).
#if HWY_TARGET == HWY_AVX3
  const FactorInScale in_scale = kFactorInScale ? MakeFactorInScale(shift, k) : FactorInScale{k, 0.0f};
  const VF scale_offset = hn::Set(d, in_scale.offset);
  const double polynomial_factor = in_scale.k;
#else
  const double polynomial_factor = k;
#endif
  const ExpPolynomial<kFolded && !kFactorInScale> poly(d, kFolded ? polynomial_factor : 1.0);
  // Inlined into each loop: an outlined call per vector made the fp16-to-fp32 gradient 1.6x
  // slower (GCC 12 stopped inlining it when the kernels moved into their own files).
  auto element = [&](VF x) __attribute__((always_inline)) {
    VF slope;
    const VF z = TransformWithSlope<kKind>(d, x, t, &slope);
    // (z is at most lse, or 88 above a wrong one, given to the staged API)
    VF g;
    if constexpr (kFactorInScale) {
#if HWY_TARGET == HWY_AVX3
      g = ExponentialFactorInScale(d, z, lanes_shift.range.low, scale_offset, poly);
#endif
    } else {
      g = HWY_UNLIKELY(subtract_first) ? ExpShiftedAs<true, false, true>(d, z, lanes_shift, poly)
                                       : ExpShiftedAs<false, false, true>(d, z, lanes_shift, poly);
    }
    if constexpr (kEntropy) {
      const VF offset = hn::Max(hn::Sub(hn::Sub(z, mean_logit_hi), mean_logit_lo), lowest_offset);
      g = hn::MulSub(g, hn::MulAdd(offset, entropy_coefficient, scaled_coefficient), scaled_uniform);
    } else if constexpr (!kFolded) {
      g = hn::MulSub(g, scaled_coefficient, scaled_uniform);
    }
    if constexpr (kKind != kIdentity) g = hn::Mul(g, slope);
    return g;
  };
  constexpr int64_t kAhead = 1024;  // elements prefetched ahead of the loads
  int64_t v = 0;
  // 16-bit logits, a folded factor, no transform, z itself the argument (the FMA targets but
  // AVX-512, whose VSCALEFPS takes 2^(n + E) in one operation): where every result of two
  // vectors is normal (their z from NormalResultsFrom on: a logit 80 or more below the lse
  // is rare), k e^r with 2^(n + E) added to its exponent bits (exact between normal numbers;
  // the 16-bit logits' NaNs stay NaN, as in ExponentialBelowShift): the biased exponent's
  // subtraction gone, the multiplication off the FMA ports, and one test for two vectors.
  constexpr bool kExponentAdded =
      kExactArgument && HWY_TARGET != HWY_AVX3 && kFolded && kKind == kIdentity && !std::is_same_v<T, float>;
  const bool add_exponents = kExponentAdded && !subtract_first;
  const VF normal_results = hn::Set(d, add_exponents ? NormalResultsFrom(shift, k) : 0.0f);
  auto all_normal = [&](VF z0, VF z1) __attribute__((always_inline)) {
    return hn::AllFalse(d, hn::Lt(hn::Min(z0, z1), normal_results));
  };
  // k e^(z - lse) as k e^r with 2^(n + E) added to its exponent bits (AddExponent).
  auto exponent_added = [&](VF z) __attribute__((always_inline)) {
    const auto [r, exponent] = ReduceForAddition(d, z, lanes_shift.range.exponent_shift);
    return AddExponent(d, poly.Horner(r), exponent);
  };
  // From v on, two vectors at a time, each g stored by store(g, at), exponent_added's where
  // both are normal, element's elsewhere.
  auto two_at_a_time = [&](auto store) __attribute__((always_inline)) {
    if (!add_exponents) return;
    for (; v + 2 * lanes <= cols; v += 2 * lanes) {
      hwy::Prefetch(row + v + kAhead);
      const VF z0 = LoadFull(d, row + v), z1 = LoadFull(d, row + v + lanes);
      if (HWY_LIKELY(all_normal(z0, z1))) {
        store(exponent_added(z0), v);
        store(exponent_added(z1), v + lanes);
      } else {
        store(element(z0), v);
        store(element(z1), v + lanes);
      }
    }
  };
  // An fp32 gradient in its own buffer is written with non-temporal stores, which skip
  // reading each line before writing it; they need aligned addresses, so the first
  // elements up to an aligned one are stored normally (one partial vector at most). (In
  // place, the lines are in cache; a gradient not aligned to its 4 bytes, which the public
  // entries refuse, never reaches an aligned address and takes the ordinary stores.)
  const bool stream = std::is_same_v<G, float> && static_cast<const void*>(grad) != static_cast<const void*>(row) &&
                      reinterpret_cast<uintptr_t>(grad) % sizeof(float) == 0 && streaming_stores_allowed();
  if (stream) {
    const auto misalignment = reinterpret_cast<uintptr_t>(grad) % (lanes * sizeof(float));
    int64_t peel = misalignment == 0 ? 0 : (static_cast<int64_t>(lanes * sizeof(float) - misalignment) / 4);
    peel = std::min(peel, cols);
    if (peel > 0)
      StorePartial(d, element(LoadPartial(d, row, static_cast<size_t>(peel))), grad, static_cast<size_t>(peel));
    v = peel;
    if constexpr (std::is_same_v<G, float>) {
      two_at_a_time([&](VF g, int64_t at) __attribute__((always_inline)) { hn::Stream(g, d, grad + at); });
      for (; v + lanes <= cols; v += lanes) {
        hwy::Prefetch(row + v + kAhead);
        hn::Stream(element(LoadFull(d, row + v)), d, grad + v);
      }
    }
    hwy::FlushStream();
  } else {
    // bf16 pairs in and out, rounded in integers (also where AVX512-BF16 is at hand: its
    // VCVTNE2PS2BF16 and the VPERMW that orders its output cost more).
    if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<G, BFloat16>) {
      // The exponents added (above) where every result is normal.
      if (add_exponents) {
#if HWY_TARGET == HWY_AVX2
        // Two pairs a step, under one test of their four vectors (and one prefetch, a
        // line): 4 instructions fewer a pair. On AVX2 where the bound is below 0 (an lse
        // below 87 - ln(1 / |k|), as almost always: kPatterns), the test reads the bf16
        // patterns: every z is at least the bound exactly where no pattern, read as an
        // unsigned integer, exceeds `most`, the bound's own truncated to bf16 (a value at
        // least the bound; the positive values' patterns lie below it, the negative ones'
        // in the order of their magnitudes, and a NaN with the sign set fails, as -inf
        // does): 3 integer operations for the four vectors where the values' test took 5,
        // 4 of them on the FPU's ports (tests/exp_test.cc sweeps logits across the bound).
        const hn::RebindToUnsigned<DF> du;
        const VU most = hn::Set(du, (hn::GetLane(hn::BitCast(du, normal_results)) >> 16) * 0x10001u);
#endif
        auto two_pairs_at_a_time = [&](auto patterns) __attribute__((always_inline)) {
          [[maybe_unused]] constexpr bool kPatterns = decltype(patterns)::value;
          for (; v + 4 * lanes <= cols; v += 4 * lanes) {
            hwy::Prefetch(row + v + kAhead);
            const VU words0 = LoadBf16Words(row + v), words1 = LoadBf16Words(row + v + 2 * lanes);
            VF even0, odd0, even1, odd1;
            SplitBf16Words(d, words0, even0, odd0);
            SplitBf16Words(d, words1, even1, odd1);
            bool normal;
#if HWY_TARGET == HWY_AVX2
            if constexpr (kPatterns) {
              normal = PatternsAtMost(words0, words1, most);
            } else
#endif
            {
              normal = all_normal(hn::Min(even0, odd0), hn::Min(even1, odd1));
            }
            if (HWY_LIKELY(normal)) {
              StoreBf16PairsHalfway(exponent_added(even0), exponent_added(odd0), grad + v);
              StoreBf16PairsHalfway(exponent_added(even1), exponent_added(odd1), grad + v + 2 * lanes);
            } else {
              StoreBf16PairsHalfway(element(even0), element(odd0), grad + v);
              StoreBf16PairsHalfway(element(even1), element(odd1), grad + v + 2 * lanes);
            }
          }
        };
#if HWY_TARGET == HWY_AVX2
        if (hn::GetLane(normal_results) < 0.0f) two_pairs_at_a_time(std::true_type{});
#endif
        two_pairs_at_a_time(std::false_type{});  // (the rest, if the above did not run)
      }
      for (; v + 2 * lanes <= cols; v += 2 * lanes) {
        hwy::Prefetch(row + v + kAhead);
        VF even, odd;
        LoadTwo(d, row + v, even, odd);
        StoreBf16PairsHalfway(element(even), element(odd), grad + v);
      }
    }
    two_at_a_time([&](VF g, int64_t at)
                      __attribute__((always_inline)) { StoreGradient<kHardwareBf16>(d, g, grad + at); });
    for (; v + lanes <= cols; v += lanes) {
      hwy::Prefetch(row + v + kAhead);
      StoreGradient<kHardwareBf16>(d, element(LoadFull(d, row + v)), grad + v);
    }
  }
  if (v < cols) {
    const auto tail = static_cast<size_t>(cols - v);
    StorePartial(d, element(LoadPartial(d, row + v, tail)), grad + v, tail);
  }
}

// Whether a gradient's factor can ride in the exp's polynomial: a factor of moderate size,
// so that the polynomial's coefficients times it neither overflow nor lose bits to underflow
// (otherwise the multiply-subtract, as with smoothing; NaN fails too).
inline bool Foldable(double k) { return std::fabs(k) >= 0x1p-60 && std::fabs(k) <= 0x1p60; }

// The gradient of a block for the transform's kind: g = upstream (1 + 2 zl lse) e^(z - lse)
// - upstream s / Vv, the first term's factor in fp64 once per block.
//   With FMA (AVX2, AVX-512: kExactArgument), the lanes take e^(z - lse) with z itself as the
//   exponential's argument (ExponentialScaled), so the result's error does not grow with
//   |z - lse|.
//   The targets without FMA shift by the block's max m instead of lse, e^(z - m) e^(m - lse):
//   a pass over the block for its max (which then stays in cache for the next), the
//   argument's rounding 2^-24 |z - m| relative, no larger than in Megatron's exp(z - max),
//   where |z - lse| exceeds |z - max| by up to log Vv.
template <class T, class G, int kKind, bool kHardwareBf16>
void GradientForKind(const T* row, G* grad, int64_t cols, const TransformParams& t, const GradientConstants& c) {
  const DF d;
  const double upstream = c.exact_upstream * c.z_loss_factor;
  const auto u = static_cast<float>(c.exact_upstream * c.exact_uniform);
  if constexpr (kExactArgument) {
    const LaneShift shift = MakeLaneShift(d, c.exact_lse);
    const double k = upstream * shift.correction;
    if (c.exact_entropy != 0.0) {
      return GradientLoop<T, G, kKind, kHardwareBf16, false, true>(row, grad, cols, t, shift, k, u,
                                                                   c.exact_entropy * shift.correction, &c);
    }
    if (u == 0.0f && Foldable(k)) {
#if HWY_TARGET == HWY_AVX3
      if constexpr (kKind == kIdentity) {  // (the transforms keep the compensated polynomial)
        if (FactorFitsInScale(shift))
          return GradientLoop<T, G, kKind, kHardwareBf16, true, false, true>(row, grad, cols, t, shift, k, 0.0f);
      }
#endif
      return GradientLoop<T, G, kKind, kHardwareBf16, true>(row, grad, cols, t, shift, k, 0.0f);
    }
    return GradientLoop<T, G, kKind, kHardwareBf16, false>(row, grad, cols, t, shift, k, u);
  } else {
    const float max = BlockMax<T, kKind>(row, cols, t);
    // A block of -inf (every p 0) takes the shift 0, where e^(-inf - 0) is 0.
    const float m = max == -std::numeric_limits<float>::infinity() ? 0.0f : max;
    const LaneShift shift = MakeLaneShift(d, m);
    // (0 for a block of -inf, NaN for a row whose lse is NaN or +inf, or -inf)
    const double relative = std::exp(static_cast<double>(max) - c.exact_lse);
    const double factor = upstream * relative;
    const double k = factor * shift.correction;
    if (c.exact_entropy != 0.0) {
      return GradientLoop<T, G, kKind, kHardwareBf16, false, true>(row, grad, cols, t, shift, k, u,
                                                                   c.exact_entropy * relative * shift.correction, &c);
    }
    if (u == 0.0f && Foldable(k))
      return GradientLoop<T, G, kKind, kHardwareBf16, true>(row, grad, cols, t, shift, k, 0.0f);
    return GradientLoop<T, G, kKind, kHardwareBf16, false>(row, grad, cols, t, shift, k, u);
  }
}

template <class T, class G, bool kHardwareBf16>
void GradientForTransform(const T* row, G* grad, int64_t cols, const TransformParams& t, const GradientConstants& c) {
  if (t.cap > 0.0f) return GradientForKind<T, G, kSoftCapped, kHardwareBf16>(row, grad, cols, t, c);
  if (t.scale != 1.0f) return GradientForKind<T, G, kScaled, kHardwareBf16>(row, grad, cols, t, c);
  return GradientForKind<T, G, kIdentity, kHardwareBf16>(row, grad, cols, t, c);
}

template <class T, class G>
void GradientForTypes(const void* row, void* grad, int64_t cols, const TransformParams& t, const GradientConstants& c) {
  const T* r = static_cast<const T*>(row);
  G* g = static_cast<G*>(grad);
#if HWY_TARGET == HWY_AVX3
  if constexpr (std::is_same_v<G, BFloat16>) {
    if (HasAvx512Bf16()) return GradientForTransform<T, G, true>(r, g, cols, t, c);
  }
#endif
  GradientForTransform<T, G, false>(r, g, cols, t, c);
}

template <class T>
void GradientForInput(const void* row, int32_t out, void* grad, int64_t cols, const TransformParams& t,
                      const GradientConstants& c) {
  WithStorageType(out, [&](auto* tag) { GradientForTypes<T, TagType<decltype(tag)>>(row, grad, cols, t, c); });
}

void BlockGradientImpl(const void* row, int32_t in, void* grad, int32_t out, int64_t cols, const TransformParams& t,
                       const GradientConstants& c) {
  WithStorageType(in, [&](auto* tag) { GradientForInput<TagType<decltype(tag)>>(row, out, grad, cols, t, c); });
}

}  // namespace HWY_NAMESPACE
}  // namespace vpce::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace vpce::detail {

HWY_EXPORT(BlockGradientImpl);

void block_gradient(const void* row, StorageType in, void* grad, StorageType out, int64_t cols,
                    const TransformParams& t, const GradientConstants& c) {
  HWY_DYNAMIC_DISPATCH(BlockGradientImpl)(row, static_cast<int32_t>(in), grad, static_cast<int32_t>(out), cols, t, c);
}

}  // namespace vpce::detail
#endif  // HWY_ONCE
