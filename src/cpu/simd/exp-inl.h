// cpu/simd/exp-inl.h: vpce's exponential for the SIMD kernels: e^(z - s) by range reduction
// and a polynomial of the degree each use needs, the shift inside a fused multiply-add (in
// base 2 on AVX-512), and bf16's rounding inside the exp (AVX-512's binade shift).
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

// The kernels take e^(z - s), s the max (forward) or the lse (backward), in one of two ways:
//
// AVX-512: as 2^t, t = z L - c, with L = log2(e) in fp32 and c = s L rounded to fp32. The
// subtraction rides in the fused multiply-add that scales the argument (exact before its one
// rounding, so z near s loses nothing, whatever their size); VREDUCEPS gives t - floor(t)
// exactly and VSCALEFPS takes floor(t) itself, so no Cody-Waite steps remain: 9 vector
// instructions where the way below takes 13. The factor 2^(c - s L) that the rounding of c
// leaves (exact in fp64, within 2^(+-ulp(c) / 2)) is folded into a per-row constant. The
// rounding of t, 2^-24 |t| relative to the result, grows with |z - s|; the backward takes s
// = the block's max (docs/design.md); (z - s)(log2(e) - L) in the exponent adds 1.3e-8
// |z - s| relative.
//
// Other targets: e^z with a Cody-Waite reduction (Exponential) whose argument is z itself, not
// z - s: n = round(z log2(e)), r = z - n ln2 exactly (ln2 in two parts), e^r by a polynomial,
// and s only in the exponent: e^(z - s) = e^r 2^(n + E) 2^phi with -s log2(e) = E + phi, E an
// integer, 2^phi in the per-row constant. So the result's error does not grow with |z - s|
// (the fp32 rounding of z - s alone would cost 2^-24 |z - s| relative: 3 ulps of an fp32
// gradient on average where the logits are close together). Without VREDUCEPS and VSCALEFPS,
// base 2 needs a floor, a conversion and a NaN fix-up and is slower there.
constexpr double kLog2eExact = 1.4426950408889634;        // log2(e) in fp64
constexpr auto kLog2e = static_cast<float>(kLog2eExact);  // L

// How exact an exponential must be, which sets its polynomial's degree:
//   kFull: everything kept or rounded to a result (the gradients of every dtype, the
//     bound's exp, the tests' exp).
//   kSums: the forward's sums over bf16 or fp16 logits, where the arithmetic rather than the
//     memory limits: on AVX-512 a polynomial of degree 5 (1.6 x 2^-24 relative against 0.22;
//     a sum's terms are positive, so its relative error is at most its terms'; the loss keeps
//     its 1e-6, docs/design.md); elsewhere kFull.
enum class ExpPrecision { kFull, kSums };

// The polynomials' coefficients, highest degree first, in one Horner sequence that ends with
// the constant term(s) 1: minimax fits for the relative error (scripts/fit_exp_polynomial.py).
//   Exp2 (AVX-512): 2^f = 1 + f Q(f), f in [0, 1): Q of degree 5 (0.22 x 2^-24 once rounded
//   to fp32) or 4 (1.6 x 2^-24).
//   Exponential (Cody-Waite): e^r = 1 + r (1 + r P(r)), |r| <= ln2 / 2: P of degree 4
//   (0.07 ulp).
constexpr float kExp2Full[] = {
    0x1.c5417ap-13f, 0x1.46d64ap-10f, 0x1.3d0b92p-7f, 0x1.c68912p-5f, 0x1.ebfd58p-3f, 0x1.62e42cp-1f, 1.0f};
constexpr float kExp2Sums[] = {0x1.e97502p-10f, 0x1.277852p-7f, 0x1.c91ce6p-5f, 0x1.ebdb56p-3f, 0x1.62e4bap-1f, 1.0f};
constexpr float kExpFull[] = {
    0x1.6a2164p-10f, 0x1.123b96p-7f, 0x1.5558fcp-5f, 0x1.55549p-3f, 0x1.fffffcp-2f, 1.0f, 1.0f};

// The polynomial's coefficients as vectors, each times k: the polynomial then gives k times
// the exponential, so that a gradient's factor rides in it (one multiplication fewer per
// vector; each coefficient rounds once to fp32, and the terms being positive, that adds at
// most 2^-24 relative). kBase2: Exp2's polynomial, else Exponential's. kCompensated: the
// constant term's rounding, k - fl32(k), is added after the last step (one addition per
// vector): it would make every result of a row err alike, by up to 2^-25 relative (a bias,
// where the roundings of the others average out), which a gradient of a whole row carries.
template <ExpPrecision kPrecision, bool kBase2, bool kCompensated = false>
struct ExpPolynomial {
  static constexpr bool kSums = kBase2 && kPrecision == ExpPrecision::kSums;
  static constexpr const float* Table() { return kBase2 ? (kSums ? kExp2Sums : kExp2Full) : kExpFull; }
  static constexpr int kTerms = kSums ? 6 : 7;
  VF c[kTerms];
  VF constant_residual;  // k - fl32(k) (kCompensated)
  explicit ExpPolynomial(DF d, double k = 1.0) {
    for (int i = 0; i < kTerms; ++i) c[i] = hn::Set(d, static_cast<float>(k * static_cast<double>(Table()[i])));
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

// Which polynomial ExpShifted takes on this target.
constexpr bool kShiftedBase2 = HWY_TARGET == HWY_AVX3;
template <ExpPrecision kPrecision, bool kCompensated = false>
using ShiftedPolynomial = ExpPolynomial<kPrecision, kShiftedBase2, kCompensated>;

#if HWY_TARGET == HWY_AVX3
// k 2^t in fp32 lanes (k from the polynomial, 1 unless a gradient's factor rides in it), 0
// for t = -inf or below -150, +inf above 128, NaN for NaN (accuracy: tests/exp_test.cc
// measures e^(x - s) on every target).
//   t = n + f with n = floor(t) and f in [0, 1) (VREDUCEPS: exact; 0 for +-inf); k 2^f by
//   Horner; times 2^n by VSCALEFPS (one rounding, into the subnormals too).
template <class Poly>
HWY_INLINE VF Exp2(VF t, const Poly& poly) {
  const VF f{_mm512_reduce_ps(t.raw, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
  return VF{_mm512_scalef_ps(poly.Horner(f).raw, t.raw)};  // times 2^floor(t)
}
#endif

// Whether the exponential takes z itself as its argument (ExponentialScaled, with e^-s in its
// exponent): Cody-Waite's n ln2 is then of any size, so r = z - n ln2 needs a fused
// multiply-add to stay exact. AVX-512 (Exp2) and the targets without FMA (SSE4, SSSE3,
// scalar) subtract the shift instead, and the backward shifts by the block's max there.
constexpr bool kExactArgument = HWY_TARGET != HWY_AVX3 && HWY_NATIVE_FMA;

using DI = hn::RebindToSigned<DF>;
using VI = hn::Vec<DI>;
constexpr float kRoundingShift = 0x1.8p23f;  // 1.5 x 2^23: x + it rounds x to an integer
constexpr int32_t kRoundingShiftBits = 0x4B400000;

// The arguments of ExponentialScaled for a shift: the clamp of x, where its results are all
// normal, and E (as the bits of 1.5 x 2^23 minus E - 127: bits(x + 1.5 x 2^23) minus it is
// n + E + 127, the biased exponent of 2^(n + E)).
struct ScaledRange {
  VF low;            // e^(low) 2^E is e^-150 (times any k up to 2^60: below fp32's subnormals)
  VF normal_low;     // between it and normal_high, 2^(n + E) is normal: e^-87 (and E)
  VF normal_high;    // e^88 (and E)
  VF high;           // e^89 (and E)
  VI exponent_bias;  // bits of 1.5 x 2^23 minus E minus 127
};

HWY_INLINE ScaledRange MakeScaledRange(DF d, double s, int32_t exponent) {
  return {hn::Set(d, static_cast<float>(s - 150.0)), hn::Set(d, static_cast<float>(s - 87.0)),
          hn::Set(d, static_cast<float>(s + 88.0)), hn::Set(d, static_cast<float>(s + 89.0)),
          hn::Set(DI(), kRoundingShiftBits - exponent - 127)};
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
HWY_INLINE VF CodyWaite(DF d, VF x, VF rounding_shift, VF& shifted) {
  shifted = hn::MulAdd(x, hn::Set(d, kLog2e), rounding_shift);
  const VF n = hn::Sub(shifted, rounding_shift);
  const VF r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), x);  // ln2 to 15 bits
  return hn::MulAdd(n, hn::Set(d, -1.4286068202862268e-6f), r);    // the rest of ln2
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
template <bool kNoneAbove = false, class Poly>
HWY_INLINE VF ExponentialScaled(DF d, VF x, const ScaledRange& range, const Poly& poly) {
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
}

// ExponentialScaled for the forward's sums of e^(z - s), s their running max, so that every
// z is at most s: z is clamped to range.normal_low (e^-87 then stands for every smaller
// term, -inf's included: at most V x 1.6e-38 in a sum that is at least 1), and 2^(n + E) is
// at most 2^1, so one power of two always does. 4 vector operations fewer.
template <class Poly>
HWY_INLINE VF ExponentialBelowShift(DF d, VF x, const ScaledRange& range, const Poly& poly) {
  const VF clamped = hn::Max(range.normal_low, x);  // (the bound first: NaN passes, as above)
  const auto [r, biased] = Reduce(d, clamped, range);
  return KeepNaN(x, TimesPowerOfTwo(d, poly.Horner(r), biased));
}

// k exp(x) (k as above).
template <class Poly>
HWY_INLINE VF Exponential(DF d, VF x, const Poly& poly) {
  return ExponentialScaled(d, x, MakeScaledRange(d, 0.0, 0), poly);
}

HWY_INLINE VF Exponential(DF d, VF x) { return Exponential(d, x, ExpPolynomial<ExpPrecision::kFull, false>(d)); }

// What the lanes need of a shift s, in vectors the loops keep in registers.
struct ShiftLanes {
  VF value;  // AVX-512: what the lanes subtract, c (or s, subtract_first); elsewhere s (subtract_first only)
#if HWY_TARGET != HWY_AVX3
  ScaledRange range;  // the exponential's clamp and E
#endif
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

HWY_INLINE LaneShift MakeLaneShift(DF d, double s) {
  const double s_log2 = s * kLog2eExact;
#if HWY_TARGET == HWY_AVX3
  const double s32_log2 = static_cast<double>(static_cast<float>(s)) * static_cast<double>(kLog2e);  // exact
  const auto c = static_cast<float>(s32_log2);
  const double residual = static_cast<double>(static_cast<float>(s)) - s;
  // (e^(fl32(s) - s), 1 for an s of fp32 or one that is not finite)
  const double s_factor = residual == 0.0 || !(residual - residual == 0.0) ? 1.0 : std::exp(residual);
  // Beyond |s log2(e)| = 2^27 (|s| about 9.3e7), c can miss s log2(e) by half of fp32's
  // spacing there (8 and more: 256 at 2^32), and 2^(z log2(e) - c), 2^(s log2(e) - c) for the
  // max, would leave fp32's range (the loss -inf, NaN or wrong). Where the miss exceeds 8 the
  // lanes subtract s first, exactly for the terms that count (Sterbenz), at one more operation
  // per vector; every other row keeps the one fused multiply-subtract.
  if (std::fabs(static_cast<double>(c) - s32_log2) > 8.0) {
    return {{hn::Set(d, static_cast<float>(s))}, s32_log2, s_factor, true};
  }
  return {{hn::Set(d, c)}, static_cast<double>(c), std::exp2(static_cast<double>(c) - s32_log2) * s_factor};
#else
  if (!kExactArgument || !(std::fabs(s) < 0x1p21)) {  // (and NaN, infinities): e^(z - fl32(s))
    const auto s32 = static_cast<float>(s);
    const double residual = static_cast<double>(s32) - s;
    const double factor = residual == 0.0 || !(residual - residual == 0.0) ? 1.0 : std::exp(residual);
    return {{hn::Set(d, s32), MakeScaledRange(d, 0.0, 0)}, static_cast<double>(s32) * kLog2eExact, factor, true};
  }
  const double exponent = std::nearbyint(-s_log2);  // E
  return {
      {hn::Zero(d), MakeScaledRange(d, s, static_cast<int32_t>(exponent))}, -exponent, std::exp2(-exponent - s_log2)};
#endif
}

#if HWY_TARGET != HWY_AVX3
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
#endif

// k e^(z - s) up to the factor shift.correction (k from the polynomial), from the shift's
// lanes, with kSubtractFirst = shift.subtract_first known at compile time (for a loop that
// tests it once, not at every vector). kBelowShift: every z is at most s and the results are
// summed (ExponentialBelowShift).
// kAtMostShift: every z is at most s (+ 88): a gradient's z and its lse
// (ExponentialScaled<true>).
template <bool kSubtractFirst, bool kBelowShift = false, bool kAtMostShift = false, class Poly>
HWY_INLINE VF ExpShiftedAs(DF d, VF z, const ShiftLanes& shift, const Poly& poly) {
#if HWY_TARGET == HWY_AVX3
  if constexpr (kSubtractFirst) return Exp2(hn::Mul(hn::Sub(z, shift.value), hn::Set(d, kLog2e)), poly);
  return Exp2(hn::MulSub(z, hn::Set(d, kLog2e), shift.value), poly);
#else
  const VF x = kSubtractFirst ? hn::Sub(z, shift.value) : z;
  if constexpr (kBelowShift) return ExponentialBelowShift(d, x, shift.range, poly);
  return ExponentialScaled<kAtMostShift>(d, x, shift.range, poly);
#endif
}

// k e^(z - s) up to the factor shift.correction (k from the polynomial).
template <class Poly>
HWY_INLINE VF ExpShifted(DF d, VF z, const LaneShift& shift, const Poly& poly) {
  return HWY_UNLIKELY(shift.subtract_first) ? ExpShiftedAs<true>(d, z, shift.lanes, poly)
                                            : ExpShiftedAs<false>(d, z, shift.lanes, poly);
}

// e^(z - s) up to the factor shift.correction.
HWY_INLINE VF ExpShifted(DF d, VF z, const LaneShift& shift) {
  return ExpShifted(d, z, shift, ShiftedPolynomial<ExpPrecision::kFull>(d));
}

#if HWY_TARGET == HWY_AVX3
// A bf16 gradient K e^(z - s) rounded inside the exp, for AVX-512 without AVX512-BF16: the
// shift c moved by the fraction of log2|K| (then rounded to fp32) makes the polynomial's
// factor K 2^(c - s log2(e)) = +-2^e (1 + mu), |mu| <= kMaxExcess, so every value of the
// polynomial, +-2^e (1 + mu) 2^f for f in [0, 1) with its error of 1.3e-8, lies within
// 2^-9 of the binade [2^e, 2^(e+1)] in relative terms. Adding and subtracting 1.5 x 2^(e+16)
// rounds it to nearest even on the grid 2^(e-7): bf16's 8 bits inside the binade, and the
// end 2^e or 2^(e+1) for a value just outside it, which is what bf16 rounds it to as well
// (it is nearer than half of bf16's spacing there). So the bits are those of rounding the
// polynomial's fp32 value; VSCALEFPS's power of two keeps them (a result below 2^-126 rounds
// again, into fp32's subnormals, and the packing then truncates it). Two vector operations
// per 16 values instead of the integer rounding's five (StoreBf16PairsSoftware). `valid` is
// false where the shift's fp32 rounding leaves too large a mu: |c| above 2^16 (logits beyond
// about +-45000) may.
struct BinadeShift {
  static constexpr double kMaxExcess = 1.5e-3;  // + the polynomial's error < 2^-9
  LaneShift shift;
  double coefficient;  // K 2^(c - s log2(e)): +-2^e (1 + mu)
  VF grid;             // +-1.5 x 2^(e+16), the sign of K
  bool valid;
};

HWY_INLINE BinadeShift MakeBinadeShift(DF d, float s, double k) {
  const double s_log2 = static_cast<double>(s) * static_cast<double>(kLog2e);  // exact
  const double log2_k = std::log2(std::fabs(k));
  const double e = std::ceil(log2_k);
  const double target = s_log2 + (e - log2_k);
  if (!(std::fabs(target) < 0x1p30)) return {MakeLaneShift(d, s), k, hn::Zero(d), false};  // (NaN, infinities)
  const auto c = static_cast<float>(target);
  const double correction = std::exp2(static_cast<double>(c) - s_log2);
  const double coefficient = k * correction;
  const double excess = std::fabs(coefficient) / std::exp2(e) - 1.0;
  const bool valid = std::fabs(excess) <= BinadeShift::kMaxExcess;
  const auto grid = static_cast<float>(std::copysign(1.5 * std::exp2(e + 16.0), k));
  return {{{hn::Set(d, c)}, static_cast<double>(c), correction}, coefficient, hn::Set(d, grid), valid};
}

// k e^(z - s) as ExpShifted gives it, rounded to bf16 on the way (k and the shift from a
// valid BinadeShift).
template <class Poly>
HWY_INLINE VF ExpShiftedBf16(DF d, VF z, const BinadeShift& binade, const Poly& poly) {
  const VF t = hn::MulSub(z, hn::Set(d, kLog2e), binade.shift.lanes.value);
  const VF f{_mm512_reduce_ps(t.raw, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
  // With the rounding mode in the instructions: to nearest whatever MXCSR says, and never
  // folded away (as fast-math may fold `(p + grid) - grid` written with + and -).
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 sum = _mm512_add_round_ps(poly.Horner(f).raw, binade.grid.raw, kNearest);
  const __m512 rounded = _mm512_sub_round_ps(sum, binade.grid.raw, kNearest);
  return VF{_mm512_scalef_ps(rounded, t.raw)};  // times 2^floor(t)
}
#else
struct BinadeShift {};  // (other targets round bf16 after the exp)
#endif

}  // namespace HWY_NAMESPACE
}  // namespace vpce::detail
HWY_AFTER_NAMESPACE();

#endif  // VPCE_CPU_SIMD_EXP_INL_H_
