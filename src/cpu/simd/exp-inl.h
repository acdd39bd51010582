// cpu/simd/exp-inl.h: vpce's exponential for the SIMD kernels: e^(z - s) by Cody-Waite's
// reduction of z itself and one polynomial, with e^-s in the exponent.
// A Highway per-target header: included by each src/cpu/simd_*.cc after
// <hwy/foreach_target.h>, once per target (the guard toggles with HWY_TARGET_TOGGLE).
#if defined(VPCE_CPU_SIMD_EXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef VPCE_CPU_SIMD_EXP_INL_H_
#undef VPCE_CPU_SIMD_EXP_INL_H_
#else
#define VPCE_CPU_SIMD_EXP_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/simd/vectors-inl.h"

HWY_BEFORE_NAMESPACE();
namespace vpce::detail {
namespace HWY_NAMESPACE {

// ---- the exponential ------------------------------------------------------------------------

// The kernels take e^(z - s), s the max (forward) or the lse (backward), as e^z with a
// Cody-Waite reduction whose argument is z itself, not z - s: n = round(z log2(e)), r = z -
// n ln2 exactly (ln2 in two parts, exact with FMA), e^r by a polynomial, and s only in the
// exponent: e^(z - s) = e^r 2^(n + E) 2^phi with -s log2(e) = E + phi, E an integer, 2^phi in
// the per-row constant. So the result's error does not grow with |z - s| (the fp32 rounding
// of z - s alone would cost 2^-24 |z - s| relative: 3 ulps of an fp32 gradient on average
// where the logits are close together). The power of two is VSCALEFPS on AVX-512, one or two
// exponent multiplications elsewhere. (Base 2 on AVX-512, 2^t with t = z L - c by VREDUCEPS
// and VSCALEFPS, took 9 operations where this takes 13, but the rounding of t, 2^-24 |t|, and
// L's, 1.3e-8 |z - s| always the same way, left its gradients 2-3 ulps off on average and
// biased its sums: docs/design.md.)
constexpr double kLog2eExact = 1.4426950408889634;        // log2(e) in fp64
constexpr auto kLog2e = static_cast<float>(kLog2eExact);  // L

// The polynomial's coefficients, highest degree first, in one Horner sequence that ends with
// the constant terms 1: e^r = 1 + r (1 + r P(r)), |r| <= ln2 / 2, P of degree 4 (0.07 ulp), a
// minimax fit for the relative error (scripts/fit_exp_polynomial.py). Every use takes it:
// the lower degrees once used for sums and half-precision gradients biased them.
constexpr float kExpCoefficients[] = {
    0x1.6a2164p-10f, 0x1.123b96p-7f, 0x1.5558fcp-5f, 0x1.55549p-3f, 0x1.fffffcp-2f, 1.0f, 1.0f};

// The polynomial's coefficients as vectors, each times k: the polynomial then gives k times
// the exponential, so that a gradient's factor rides in it (one multiplication fewer per
// vector; each coefficient rounds once to fp32, and the terms being positive, that adds at
// most 2^-24 relative). kCompensated: the constant term's rounding, k - fl32(k), is added
// after the last step (one addition per vector): it would make every result of a row err
// alike, by up to 2^-25 relative (a bias, where the roundings of the others average out),
// which a gradient of a whole row carries.
template <bool kCompensated = false>
struct ExpPolynomial {
  static constexpr int kTerms = 7;
  VF c[kTerms];
  VF constant_residual;  // k - fl32(k) (kCompensated)
  explicit ExpPolynomial(DF d, double k = 1.0) {
    for (int i = 0; i < kTerms; ++i) {
      c[i] = hn::Set(d, static_cast<float>(k * static_cast<double>(kExpCoefficients[i])));
    }
    // (The constant term is 1: it rounds to fl32(k).)
    constant_residual = hn::Set(d, static_cast<float>(k - static_cast<double>(static_cast<float>(k))));
  }
  HWY_INLINE VF Horner(VF x) const {
    VF q = c[0];
    for (int i = 1; i < kTerms; ++i) q = hn::MulAdd(q, x, c[i]);
    if constexpr (kCompensated) q = hn::Add(q, constant_residual);
    return q;
  }
};

// Whether the exponential takes z itself as its argument (ExponentialScaled, with e^-s in
// its exponent): Cody-Waite's n ln2 is then of any size, so r = z - n ln2 needs a fused
// multiply-add to stay exact. The targets without FMA (SSE4, SSSE3, scalar) subtract the
// shift instead, and their backward shifts by the block's max.
constexpr bool kExactArgument = HWY_NATIVE_FMA;

using DI = hn::RebindToSigned<DF>;
using VI = hn::Vec<DI>;
constexpr float kRoundingShift = 0x1.8p23f;  // 1.5 x 2^23: x + it rounds x to an integer
constexpr int32_t kRoundingShiftBits = 0x4B400000;

// The arguments of ExponentialScaled for a shift: the clamp of x, where its results are all
// normal, and E (as the bits of 1.5 x 2^23 minus E - 127: bits(x + 1.5 x 2^23) minus it is
// n + E + 127, the biased exponent of 2^(n + E)).
struct ScaledRange {
  VF low;             // e^(low) 2^E is e^-150 (times any k up to 2^60: below fp32's subnormals)
  VF normal_low;      // between it and normal_high, 2^(n + E) is normal: e^-87 (and E)
  VF normal_high;     // e^88 (and E)
  VF high;            // e^89 (and E)
  VI exponent_bias;   // bits of 1.5 x 2^23 minus E minus 127
  VF scale_shift;     // 1.5 x 2^23 - E (exact, |E| < 2^22): the rounding shift minus it is n + E
  VF exponent_shift;  // 1.5 x 2^23 + E: ReduceForAddition's rounding shift
};

HWY_INLINE ScaledRange MakeScaledRange(DF d, double s, int32_t exponent) {
  return {hn::Set(d, static_cast<float>(s - 150.0)),
          hn::Set(d, static_cast<float>(s - 87.0)),
          hn::Set(d, static_cast<float>(s + 88.0)),
          hn::Set(d, static_cast<float>(s + 89.0)),
          hn::Set(DI(), kRoundingShiftBits - exponent - 127),
          hn::Set(d, kRoundingShift - static_cast<float>(exponent)),
          hn::Set(d, kRoundingShift + static_cast<float>(exponent))};
}

// Cody-Waite's reduction of x for ExponentialScaled and ExponentialBelowShift: r = x - n ln2
// (exact with FMA), n = round(x log2 e) taken from the rounding shift's low bits, and
// n + E + 127, the biased exponent of 2^(n + E).
struct Reduced {
  VF r;
  VI biased;
};
// r = x - n ln2 for n = round(x log2 e), rounded by adding `rounding_shift` (1.5 x 2^23 plus
// an integer below 2^22), which `shifted` keeps: its low bits hold n plus that integer.
constexpr float kLn2High = 0.693145751953125f;     // ln2 to 15 bits: n times it is exact
constexpr float kLn2Low = 1.4286068202862268e-6f;  // the rest of ln2, lambda
// Its first step: n, and x - n kLn2High (exact), which the second step's n kLn2Low completes.
HWY_INLINE VF CodyWaiteHigh(DF d, VF x, VF rounding_shift, VF& shifted, VF& n) {
  shifted = hn::MulAdd(x, hn::Set(d, kLog2e), rounding_shift);
  n = hn::Sub(shifted, rounding_shift);
  return hn::MulAdd(n, hn::Set(d, -kLn2High), x);
}
HWY_INLINE VF CodyWaite(DF d, VF x, VF rounding_shift, VF& shifted) {
  VF n;
  const VF high = CodyWaiteHigh(d, x, rounding_shift, shifted, n);
  return hn::MulAdd(n, hn::Set(d, -kLn2Low), high);
}

HWY_INLINE Reduced Reduce(DF d, VF x, const ScaledRange& range) {
  const DI di;
  VF shifted;
  const VF r = CodyWaite(d, x, hn::Set(d, kRoundingShift), shifted);
  return {r, hn::Sub(hn::BitCast(di, shifted), range.exponent_bias)};
}

// Reduce with E in the rounding shift instead (`exponent_shift`, 1.5 x 2^23 + E, exact for
// |E| < 2^22): bits(shifted) << 23 is then (n + E) << 23 (the shift's own bits, 0x4B400000,
// leave nothing there), which AddExponent adds to k e^r's bits: 2^(n + E) without the biased
// exponent's subtraction or a multiplication (one operation fewer, and one fewer on the FMA
// ports).
struct ReducedForAddition {
  VF r;
  VI exponent;  // (n + E) << 23
};
HWY_INLINE ReducedForAddition ReduceForAddition(DF d, VF x, VF exponent_shift) {
  const DI di;
  VF shifted;
  const VF r = CodyWaite(d, x, exponent_shift, shifted);
  return {r, hn::ShiftLeft<23>(hn::BitCast(di, shifted))};
}

// value 2^(n + E) by adding the exponent's bits: exact where value and the result are normal
// numbers. A NaN stays NaN where x's NaN had its low 9 bits 0, so that `exponent` is 0: a
// widened bf16 logit's NaN has them (its payload is in the upper half), and so has the NaN
// arithmetic makes; an fp32 logit's NaN need not (hence for bf16 logits only).
HWY_INLINE VF AddExponent(DF d, VF value, VI exponent) {
  const DI di;
  return hn::BitCast(d, hn::Add(hn::BitCast(di, value), exponent));
}

// k e^r times 2^(n + E), for a biased exponent n + E + 127 in [1, 254] (a normal power of two).
HWY_INLINE VF TimesPowerOfTwo(DF d, VF exp_r, VI biased) {
  return hn::Mul(exp_r, hn::BitCast(d, hn::ShiftLeft<23>(biased)));
}

// result, or x where x is NaN: x86's MIN/MAX clamps keep a NaN on their own, Highway's
// portable ones drop it.
HWY_INLINE VF KeepNaN(VF x, VF result) {
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
  return hn::IfThenElse(hn::IsNaN(x), x, result);
#else
  (void)x;
  return result;
#endif
}

// k exp(x) 2^E in fp32 lanes (k as above; E and the clamp of x from `range`): 0 below about
// e^-103.3, +inf above e^88.72, NaN for NaN.
//   x = n ln2 + r, n = round(x / ln2) by adding 1.5 * 2^23 (|x / ln2| < 2^22), |r| <= ln2 / 2
//   with ln2 in two parts (n times the first is exact); k e^r by Horner; then times 2^(n + E):
//   one power of two where every lane's is normal (x between range.normal_low and
//   normal_high, or NaN), else x clamped and two powers of two, so that results below
//   2^-126 round once into the subnormals, -inf (clamped to e^-150 2^E) gives 0 and e^88.7
//   does not overflow early. A vector with a lane outside (rare: logits 87 below the row's
//   lse) costs 7 more operations; the test of the lanes, 4.
// kNoneAbove: x is known to stay below range.normal_high (a gradient's z, at most its lse),
// so only the lower end is tested (2 operations fewer).
#if HWY_TARGET == HWY_AVX3
// AVX-512: x clamped (below only, kNoneAbove), Cody-Waite's r and n + E (from the rounding
// shift), and 2^(n + E) by VSCALEFPS, which rounds once into the subnormals and gives 0 far
// below and +inf above: no test of the lanes. 13 vector operations with kNoneAbove, else 14.
struct ScalefReduced {
  VF r;
  VF scale;  // n + E
};
template <bool kNoneAbove>
HWY_INLINE ScalefReduced ReduceForScalef(DF d, VF x, const ScaledRange& range) {
  // (the bound first: NaN passes the clamp, and the result is NaN)
  const VF clamped = kNoneAbove ? hn::Max(range.low, x) : hn::Min(range.high, hn::Max(range.low, x));
  VF shifted;
  const VF r = CodyWaite(d, clamped, hn::Set(d, kRoundingShift), shifted);
  return {r, hn::Sub(shifted, range.scale_shift)};
}
#endif

template <bool kNoneAbove = false, class Poly>
HWY_INLINE VF ExponentialScaled(DF d, VF x, const ScaledRange& range, const Poly& poly) {
#if HWY_TARGET == HWY_AVX3
  const auto [r, scale] = ReduceForScalef<kNoneAbove>(d, x, range);
  return VF{_mm512_scalef_ps(poly.Horner(r).raw, scale.raw)};
#else
  const DI di;
  const bool normal = kNoneAbove ? hn::AllFalse(d, hn::Lt(x, range.normal_low))
                                 : hn::AllFalse(d, hn::Or(hn::Lt(x, range.normal_low), hn::Gt(x, range.normal_high)));
  // The bound first: x86's MINPS and MAXPS return their second operand when either is NaN,
  // so NaN passes through the clamp (and on to the result) without a blend.
  const VF clamped = normal ? x : hn::Min(range.high, hn::Max(range.low, x));
  const auto [r, biased] = Reduce(d, clamped, range);
  const VF exp_r = poly.Horner(r);
  VF result;
  if (HWY_LIKELY(normal)) {
    result = TimesPowerOfTwo(d, exp_r, biased);
  } else {
    const VI bias = hn::Set(di, 127);
    const VI n_int = hn::Sub(biased, bias);  // n + E
    const VI half = hn::ShiftRight<1>(n_int);
    const VF scale_a = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(half, bias)));
    const VF scale_b = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::Sub(n_int, half), bias)));
    result = hn::Mul(hn::Mul(exp_r, scale_a), scale_b);
  }
  return KeepNaN(x, result);
#endif
}

// ExponentialScaled for the forward's sums of e^(z - s), s their running max, so that every
// z is at most s: z is clamped to range.normal_low (e^-87 then stands for every smaller
// term, -inf's included: at most V x 1.6e-38 in a sum that is at least 1), and 2^(n + E) is
// at most 2^1, so one power of two always does: 4 vector operations fewer (AVX-512's
// VSCALEFPS needs no test in any case).
// kUnclamped (not AVX-512): every x is known to be at least range.normal_low (the forward's
// chunks of 16-bit logits whose lowest allows it, RawMax16), where the clamp would change
// nothing: it is left out (one operation a vector fewer, on the FMA ports of Intel's cores).
// kHalfPrecisionLogits: x from bf16 or fp16 logits (widened, maybe scaled), whose NaNs have
// their low 9 bits 0: 2^(n + E) is then added to e^r's exponent (AddExponent; e^r in [0.7,
// 1.5] and the result at least e^-87 are normal), not multiplied, so the sum's addition takes
// an FADD port where its multiply-add took an FMA port: as many operations, and 9 on the FMA
// ports of a vector's 16 where there were 10 (2.3-2.7 % faster as AVX2 on an Emerald Rapids;
// no change measured on a Zen 3: docs/performance.md, entries 52 and 54).
template <bool kHalfPrecisionLogits = false, bool kUnclamped = false, class Poly>
HWY_INLINE VF ExponentialBelowShift(DF d, VF x, const ScaledRange& range, const Poly& poly) {
#if HWY_TARGET == HWY_AVX3
  static_assert(!kUnclamped, "AVX-512's forward keeps its clamp (simd_stats.cc's kRawLowest)");
  return ExponentialScaled<true>(d, x, range, poly);  // (VSCALEFPS: no cheaper form)
#else
  // (the bound first: NaN passes, as above)
  const VF clamped = kUnclamped ? x : hn::Max(range.normal_low, x);
  if constexpr (kHalfPrecisionLogits) {
    const auto [r, exponent] = ReduceForAddition(d, clamped, range.exponent_shift);
    return KeepNaN(x, AddExponent(d, poly.Horner(r), exponent));
  }
  const auto [r, biased] = Reduce(d, clamped, range);
  return KeepNaN(x, TimesPowerOfTwo(d, poly.Horner(r), biased));
#endif
}

// k exp(x) (k as above).
template <class Poly>
HWY_INLINE VF Exponential(DF d, VF x, const Poly& poly) {
  return ExponentialScaled(d, x, MakeScaledRange(d, 0.0, 0), poly);
}

HWY_INLINE VF Exponential(DF d, VF x) { return Exponential(d, x, ExpPolynomial<>(d)); }

// What the lanes need of a shift s, in vectors the loops keep in registers.
struct ShiftLanes {
  VF value;           // s (subtract_first only)
  ScaledRange range;  // ExponentialScaled's clamp and E
};

// The shift s of e^(z - s) as the lanes take it.
struct LaneShift {
  ShiftLanes lanes;
  double log2_reference;  // the lanes give 2^(z log2(e) - log2_reference): c, s log2(e) or -E
  double correction;      // 2^(log2_reference - s log2(e)): the factor from those to e^(z - s)
  // AVX-512 where c would miss s log2(e) by more than 8, elsewhere without FMA or where |s| is
  // beyond 2^21: the lanes take e^(z - fl32(s)).
  bool subtract_first = false;
};

// The shift s as ExponentialScaled's lanes take it (z itself the argument, E = round(-s
// log2(e)) in the exponent, 2^phi in the correction), or, without FMA or where |s| is beyond
// 2^21, e^(z - fl32(s)) (subtract_first): the forward's and the backward's on every target.
HWY_INLINE LaneShift MakeLaneShift(DF d, double s) {
  if (!kExactArgument || !(std::fabs(s) < 0x1p21)) {  // (and NaN, infinities): e^(z - fl32(s))
    const auto s32 = static_cast<float>(s);
    const double residual = static_cast<double>(s32) - s;
    const double factor = residual == 0.0 || !(residual - residual == 0.0) ? 1.0 : std::exp(residual);
    return {{hn::Set(d, s32), MakeScaledRange(d, 0.0, 0)}, static_cast<double>(s32) * kLog2eExact, factor, true};
  }
  const double exponent = std::nearbyint(-s * kLog2eExact);  // E
  return {{hn::Zero(d), MakeScaledRange(d, s, static_cast<int32_t>(exponent))},
          -exponent,
          std::exp2(-exponent - s * kLog2eExact)};
}

#if HWY_TARGET == HWY_AVX3
// A gradient's factor k in the polynomial without the compensation's addition (AVX-512, whose
// power of two, VSCALEFPS's, takes n + E as a float and floors it): the polynomial takes k' =
// k e^((E + f) lambda) (lambda: ln2's lower part, kLn2Low), with f in [0, 1) chosen so that k'
// is an fp32 value (|k e^(E lambda)| rounded up: f is below 2^-23 / lambda = 0.084), so its
// constant term is exact and there is nothing to compensate; the scale is n + (E + f), which
// VSCALEFPS floors to n + E, and Cody-Waite's second step subtracts it times lambda where it
// subtracted n lambda: a factor e^(-(E + f) lambda) that k' undoes. The polynomial's argument
// moves by (E + f) lambda, at most 1.5e-3 where |E| <= 1024 (FactorFitsInScale): |r| up to
// 0.348, where the polynomial's error is 0.069 ulp (0.063 within ln2 / 2). 13 vector
// operations, one fewer than the compensated polynomial's 14.
struct FactorInScale {
  double k;      // k', an fp32 value
  float offset;  // E + f (fp32, rounded: the factor then errs by at most 2^-14 lambda)
};
inline bool FactorFitsInScale(const LaneShift& shift) {
  return !shift.subtract_first && std::fabs(shift.log2_reference) <= 1024.0;
}
inline FactorInScale MakeFactorInScale(const LaneShift& shift, double k) {
  constexpr auto kLambda = static_cast<double>(kLn2Low);
  const double exponent = -shift.log2_reference;  // E
  const double a = k * std::exp(exponent * kLambda);
  auto k32 = static_cast<float>(a);
  if (std::fabs(static_cast<double>(k32)) < std::fabs(a))
    k32 = std::nextafter(k32, std::copysign(std::numeric_limits<float>::infinity(), k32));
  const double f = std::log1p((static_cast<double>(k32) - a) / a) / kLambda;
  return {static_cast<double>(k32), static_cast<float>(exponent + f)};
}
// k e^x 2^E, for x at most s (+ 88), by that factor in the scale: the polynomial made with
// k' (MakeFactorInScale), `offset` its E + f as a vector, x clamped below at range.low as
// ExponentialScaled<true> clamps it (NaN passes, -inf gives 0).
template <class Poly>
HWY_INLINE VF ExponentialFactorInScale(DF d, VF x, VF low, VF offset, const Poly& poly) {
  const VF clamped = hn::Max(low, x);  // (the bound first: NaN passes, as above)
  VF shifted, n;
  const VF high = CodyWaiteHigh(d, clamped, hn::Set(d, kRoundingShift), shifted, n);
  const VF scale = hn::Add(n, offset);
  const VF r = hn::MulAdd(scale, hn::Set(d, -kLn2Low), high);  // (n + E + f) in the second step
  return VF{_mm512_scalef_ps(poly.Horner(r).raw, scale.raw)};
}
#endif

// The least fp32 z (rounded up) from which the lanes of `shift` with a polynomial's factor k,
// k e^z 2^E, are at least 2^-125 (normal numbers, as AddExponent needs; so is 2^(n + E)):
// (-E - 125) ln2 - ln min(1, |k|). For a shift whose lanes take z itself (not
// subtract_first), where E = -log2_reference.
inline float NormalResultsFrom(const LaneShift& shift, double k) {
  constexpr double kLn2 = 0.6931471805599453;
  const double z = (shift.log2_reference - 125.0) * kLn2 - std::log(std::min(1.0, std::fabs(k)));
  const auto rounded = static_cast<float>(z);
  return static_cast<double>(rounded) < z ? std::nextafter(rounded, std::numeric_limits<float>::infinity()) : rounded;
}

// k e^(z - s) up to the factor shift.correction (k from the polynomial), from the shift's
// lanes, with kSubtractFirst = shift.subtract_first known at compile time (for a loop that
// tests it once, not at every vector). kBelowShift: every z is at most s and the results are
// summed (ExponentialBelowShift, kHalfPrecisionLogits as there).
// kAtMostShift: every z is at most s (+ 88): a gradient's z and its lse
// (ExponentialScaled<true>). kUnclamped (kBelowShift only): as ExponentialBelowShift's.
template <bool kSubtractFirst, bool kBelowShift = false, bool kAtMostShift = false, bool kHalfPrecisionLogits = false,
          bool kUnclamped = false, class Poly>
HWY_INLINE VF ExpShiftedAs(DF d, VF z, const ShiftLanes& shift, const Poly& poly) {
  static_assert(!kUnclamped || kBelowShift);
  const VF x = kSubtractFirst ? hn::Sub(z, shift.value) : z;
  if constexpr (kBelowShift) {
    return ExponentialBelowShift<kHalfPrecisionLogits, kUnclamped>(d, x, shift.range, poly);
  }
  return ExponentialScaled<kAtMostShift>(d, x, shift.range, poly);
}

// k e^(z - s) up to the factor shift.correction (k from the polynomial).
template <class Poly>
HWY_INLINE VF ExpShifted(DF d, VF z, const LaneShift& shift, const Poly& poly) {
  return HWY_UNLIKELY(shift.subtract_first) ? ExpShiftedAs<true>(d, z, shift.lanes, poly)
                                            : ExpShiftedAs<false>(d, z, shift.lanes, poly);
}

// e^(z - s) up to the factor shift.correction.
HWY_INLINE VF ExpShifted(DF d, VF z, const LaneShift& shift) { return ExpShifted(d, z, shift, ExpPolynomial<>(d)); }

}  // namespace HWY_NAMESPACE
}  // namespace vpce::detail
HWY_AFTER_NAMESPACE();

#endif  // VPCE_CPU_SIMD_EXP_INL_H_
