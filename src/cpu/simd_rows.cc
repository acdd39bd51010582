// cpu/simd_rows.cc: the per-block SIMD work of the kernels (see simd_rows.h), written once
// with Google Highway and compiled for every x86 target it attains (AVX-512, AVX2, SSE4,
// SSSE3) plus scalar; the best one the CPU supports is chosen at run time.
//
// Statistics of a block are taken a chunk of 256 vectors at a time while it is in L1: the
// chunk's max, then the sums of exp(z - m) (and of z when asked) with m the running max,
// in fp32 lanes within a chunk and fp64 across chunks; with the extras (argmax, the
// weighted sum) the whole block takes two passes from a stack buffer. The gradient reads
// each logit once and writes each gradient element once. The exp is vpce's own
// (ExpShifted: on AVX-512 in base 2, the shift inside a fused multiply-add). Loads widen
// bf16 and fp16 to fp32 (bf16 in even/odd pairs where the order does not matter); stores
// round fp32 to bf16 to nearest even (AVX512-BF16 where present) and to fp16 with F16C or
// the exact scalar conversion.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd_rows.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"

HWY_BEFORE_NAMESPACE();
namespace vpce::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr int kIdentity = 0;
constexpr int kScaled = 1;
constexpr int kSoftCapped = 2;
constexpr size_t kMaxLanes = 64;  // more than any target's fp32 lanes

// ---- loads and stores of one vector of `count` (<= lanes) elements --------------------

HWY_INLINE VF LoadFull(DF d, const float* p) { return hn::LoadU(d, p); }
HWY_INLINE VF LoadFull(DF d, const BFloat16* p) {
  const hn::Rebind<hwy::bfloat16_t, DF> dbf;
  return hn::PromoteTo(d, hn::LoadU(dbf, reinterpret_cast<const hwy::bfloat16_t*>(p)));
}
HWY_INLINE VF LoadFull(DF d, const Float16* p) {
  const hn::Rebind<hwy::float16_t, DF> dh;
  const VF v = hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
#if HWY_TARGET <= HWY_AVX2
  return v;  // F16C: exact, inf and NaN included
#else
  // Highway's emulated conversion takes fp16's exponent 31 (inf, NaN) for a normal one and
  // gives 2^16 (1 + m): finite values no fp16 can hold. Their fp32 exponent field is then
  // 143; setting all its bits makes the infinity or NaN with the same sign and mantissa.
  const hn::RebindToUnsigned<DF> du;
  const auto special = hn::Ge(hn::Abs(v), hn::Set(d, 65536.0f));
  return hn::IfThenElse(special, hn::BitCast(d, hn::Or(hn::BitCast(du, v), hn::Set(du, 0x7F800000u))), v);
#endif
}

// The first `count` elements; the other lanes are 0.
template <class T>
HWY_INLINE VF LoadPartial(DF d, const T* p, size_t count) {
  T buffer[kMaxLanes] = {};
  std::memcpy(buffer, p, count * sizeof(T));
  return LoadFull(d, buffer);
}

// 2 * lanes consecutive elements as two vectors, in an order that only sums and maxima may
// rely on: bf16 as the even and the odd positions, from one load and two integer
// operations (PromoteTo needs a shuffle and a shift per vector); other types in order.
template <class T>
HWY_INLINE void LoadTwo(DF d, const T* p, VF& first, VF& second) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    const hn::RebindToUnsigned<DF> du;
    const auto words = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));  // (odd << 16) | even
    first = hn::BitCast(d, hn::ShiftLeft<16>(words));
    second = hn::BitCast(d, hn::And(words, hn::Set(du, 0xFFFF0000u)));
  } else {
    first = LoadFull(d, p);
    second = LoadFull(d, p + hn::Lanes(d));
  }
}

HWY_INLINE void StoreFull(DF d, VF v, float* p) { hn::StoreU(v, d, p); }

#if HWY_TARGET == HWY_AVX3
// fp32 -> bf16 with AVX512-BF16's VCVTNEPS2BF16 (round to nearest even in hardware; NaN
// stays NaN; denormal inputs and outputs are flushed to zero), for CPUs that have it. Inline
// assembly: the AVX3 target that this code is compiled for lacks that extension.
HWY_INLINE void StoreBf16Hardware(VF v, BFloat16* p) {
  __m256i half;
  asm("vcvtneps2bf16 %1, %0" : "=v"(half) : "v"(v.raw));
  std::memcpy(p, &half, sizeof(half));
}

// Even- and odd-position fp32 values (as LoadTwo gives them) -> 2 * 16 bf16 in order: one
// VCVTNE2PS2BF16 (even values in the low half, odd in the high) and one word permutation.
HWY_INLINE void StoreBf16PairsHardware(VF even, VF odd, BFloat16* p) {
  __m512i packed;
  asm("vcvtne2ps2bf16 %[low], %[high], %[out]" : [out] "=v"(packed) : [high] "v"(odd.raw), [low] "v"(even.raw));
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  _mm512_storeu_si512(p, _mm512_permutexvar_epi16(order, packed));
}

// Even- and odd-position values already on bf16's grid (BinadeShift, or rounded by
// StoreBf16PairsSoftware): the odd values' upper halves and the even values' upper halves
// shifted down, merged by one VPTERNLOGD, 2 vector operations per 32 values. (A result
// below 2^-126, off the grid after VSCALEFPS, loses its lower half: truncated.)
HWY_INLINE void StoreBf16PairsRounded(VF even, VF odd, BFloat16* p) {
  const __m512i e = _mm512_castps_si512(even.raw), o = _mm512_castps_si512(odd.raw);
  // (o & 0xFFFF0000) | (e >> 16): 0xE4 selects the first operand where the third has a 1
  // bit, the second elsewhere.
  const __m512i packed = _mm512_ternarylogic_epi32(o, _mm512_srli_epi32(e, 16),
                                                   _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), 0xE4);
  _mm512_storeu_si512(p, packed);
}

// The same from any fp32 values, without AVX512-BF16 (Skylake-SP to Ice Lake), rounded in
// integer arithmetic with the bits StoreFull gives: each value plus 0x7FFF plus its bit 16
// (round to nearest even), except NaN lanes, which keep their upper half (a NaN from
// arithmetic is quiet, so that half is a NaN); then packed as above. No shuffle: 12 vector
// operations per 32 values, against about 22 for two StoreFull calls.
HWY_INLINE void StoreBf16PairsSoftware(VF even, VF odd, BFloat16* p) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  auto round = [&](VF v) {
    const __m512i bits = _mm512_castps_si512(v.raw);
    const __mmask16 ordered = _mm512_cmp_ps_mask(v.raw, v.raw, _CMP_ORD_Q);
    const __m512i increment = _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one));
    return VF{_mm512_castsi512_ps(_mm512_mask_add_epi32(bits, ordered, bits, increment))};
  };
  StoreBf16PairsRounded(round(even), round(odd), p);
}

bool HasAvx512Bf16() { return cpu_has_avx512_bf16() && bf16_instructions_allowed(); }
#endif

// Even- and odd-position fp32 values (as LoadTwo gives them) -> 2 * lanes bf16 in order,
// each rounded to nearest even in the FPU: (v + M) - M with M = 1.5 x 2^(e + 16), 2^e the
// binade of v (2^-126's for a subnormal or 0), rounds v to bf16's spacing there, 2^(e - 7)
// (2^-133 for bf16's subnormals; a value that rounds up to 2^(e + 1) takes it, as bf16
// does); NaN and inf pass unchanged (M is then finite). For |v| below 2^111 only (M must
// stay finite): the caller checks. Then the upper halves, packed: 5 vector operations per
// vector and 3 per pair, where StoreFull takes about 11 per vector (integer rounding, a NaN
// blend, a narrowing and a lane permutation).
HWY_INLINE void StoreBf16PairsNearest(DF d, VF even, VF odd, BFloat16* p) {
  const hn::RebindToUnsigned<DF> du;
  auto round = [&](VF v) {
    const auto binade = hn::Max(hn::And(hn::BitCast(du, v), hn::Set(du, 0x7F800000u)), hn::Set(du, 0x00800000u));
    const VF m = hn::BitCast(d, hn::Add(binade, hn::Set(du, 0x08400000u)));  // + 16 in the exponent, mantissa 1.5
    return hn::BitCast(du, hn::Sub(hn::Add(v, m), m));
  };
  const auto packed = hn::Or(hn::And(round(odd), hn::Set(du, 0xFFFF0000u)), hn::ShiftRight<16>(round(even)));
  hn::StoreU(packed, du, reinterpret_cast<uint32_t*>(p));
}

// fp32 -> bf16, rounding to nearest even; NaN stays a (quiet) NaN.
HWY_INLINE void StoreFull(DF /* d */, VF v, BFloat16* p) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> du16;
  const auto bits = hn::BitCast(du, v);
  const auto odd = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du, 0x7fffu), odd)));
  const auto quiet = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x40u));
  const auto nan = hn::RebindMask(du, hn::Ne(v, v));
  const auto half = hn::DemoteTo(du16, hn::BitCast(di, hn::IfThenElse(nan, quiet, rounded)));
  hn::StoreU(half, du16, reinterpret_cast<uint16_t*>(p));
}

// fp32 -> fp16, rounding to nearest even: F16C where the target has it (AVX2, AVX-512),
// else the exact scalar conversion (Highway's emulation truncates). On AVX-512, VCVTPS2PH
// writes memory itself: on Intel's AVX-512 cores that takes one slot of the 512-bit ports
// where converting into a register and storing it takes two (bench/port_probe.cc; the
// compiler does not fuse the two), and LLVM's Zen 4 model gives both forms the same cost.
// Immediate 8: to nearest even, exceptions suppressed, as Highway's DemoteTo.
HWY_INLINE void StoreFull(DF d, VF v, Float16* p) {
#if HWY_TARGET == HWY_AVX3
  // The output as 16 uint16_t, which alias neither the loop's floats nor its flags (a char
  // array would make the compiler reload them after every store).
  (void)d;
  asm("vcvtps2ph $8, %1, %0" : "=m"(*reinterpret_cast<uint16_t(*)[16]>(p)) : "v"(v.raw));
#elif HWY_TARGET <= HWY_AVX2
  const hn::Rebind<hwy::float16_t, DF> dh;
  hn::StoreU(hn::DemoteTo(dh, v), dh, reinterpret_cast<hwy::float16_t*>(p));
#else
  float values[kMaxLanes];
  hn::StoreU(v, d, values);
  const size_t lanes = hn::Lanes(d);
  for (size_t i = 0; i < lanes; ++i) p[i] = from_float<Float16>(values[i]);
#endif
}

template <class G>
HWY_INLINE void StorePartial(DF d, VF v, G* p, size_t count) {
  G buffer[kMaxLanes];
  StoreFull(d, v, buffer);
  std::memcpy(p, buffer, count * sizeof(G));
}

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
constexpr double kLog2eExact = 1.4426950408889634;  // log2(e) in fp64
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
constexpr float kExp2Full[] = {0x1.c5417ap-13f, 0x1.46d64ap-10f, 0x1.3d0b92p-7f, 0x1.c68912p-5f,
                               0x1.ebfd58p-3f,  0x1.62e42cp-1f,  1.0f};
constexpr float kExp2Sums[] = {0x1.e97502p-10f, 0x1.277852p-7f, 0x1.c91ce6p-5f, 0x1.ebdb56p-3f, 0x1.62e4bap-1f, 1.0f};
constexpr float kExpFull[] = {0x1.6a2164p-10f, 0x1.123b96p-7f, 0x1.5558fcp-5f, 0x1.55549p-3f, 0x1.fffffcp-2f, 1.0f, 1.0f};

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
  static constexpr const float* Table() {
    return kBase2 ? (kSums ? kExp2Sums : kExp2Full) : kExpFull;
  }
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
  VF low;           // e^(low) 2^E is e^-150 (times any k up to 2^60: below fp32's subnormals)
  VF normal_low;    // between it and normal_high, 2^(n + E) is normal: e^-87 (and E)
  VF normal_high;   // e^88 (and E)
  VF high;          // e^89 (and E)
  VI exponent_bias; // bits of 1.5 x 2^23 minus E minus 127
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
HWY_INLINE Reduced Reduce(DF d, VF x, const ScaledRange& range) {
  const VF rounding_shift = hn::Set(d, kRoundingShift);
  const DI di;
  const VF shifted = hn::MulAdd(x, hn::Set(d, kLog2e), rounding_shift);
  const VF n = hn::Sub(shifted, rounding_shift);
  VF r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), x);  // ln2 to 15 bits
  r = hn::MulAdd(n, hn::Set(d, -1.4286068202862268e-6f), r);  // the rest of ln2
  return {r, hn::Sub(hn::BitCast(di, shifted), range.exponent_bias)};
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
    result = hn::Mul(exp_r, hn::BitCast(d, hn::ShiftLeft<23>(biased)));
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
  return KeepNaN(x, hn::Mul(poly.Horner(r), hn::BitCast(d, hn::ShiftLeft<23>(biased))));
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
    return {{hn::Set(d, s32), MakeScaledRange(d, 0.0, 0)},
            static_cast<double>(s32) * kLog2eExact,
            factor,
            true};
  }
  const double exponent = std::nearbyint(-s_log2);  // E
  return {{hn::Zero(d), MakeScaledRange(d, s, static_cast<int32_t>(exponent))},
          -exponent,
          std::exp2(-exponent - s_log2)};
#endif
}

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

// ---- the logit transform ----------------------------------------------------------------

// The soft cap's z = cap tanh(a), a = scale x / cap, and, with `slope`, dz/dx = scale (1 -
// tanh^2 a), both from y = expm1(2|a|) as Highway's Tanh takes it: tanh |a| = y / (y + 2)
// and 1 - tanh^2 a = 4 (y + 1) / (y + 2)^2, which does not cancel where tanh saturates
// (1 - u^2 from the rounded u = tanh a did: 7.5e-4 of a row's gradient at |a| of 3 to 6.5);
// beyond |a| = 18.7 tanh rounds to 1. One expm1 and one division for both, and the forward's
// z is the backward's, bit for bit.
template <bool kWithSlope>
HWY_INLINE VF SoftCap(DF d, VF x, const TransformParams& t, VF* slope) {
  const VF a = hn::Mul(hn::Mul(x, hn::Set(d, t.scale)), hn::Set(d, t.inverse_cap));
  const VF sign = hn::And(hn::SignBit(d), a);
  const VF abs_a = hn::Xor(a, sign);
  // Expm1 holds up to 104; at 2|a| = 88 the slope, e^-88, is already below fp32's normal
  // range. (The constant first: x86's MINPS passes a NaN on.)
  const VF y = hn::Expm1(d, hn::Min(hn::Set(d, 88.0f), hn::Add(abs_a, abs_a)));
  const VF r = hn::Div(hn::Set(d, 1.0f), hn::Add(y, hn::Set(d, 2.0f)));
  const auto saturated = hn::Gt(abs_a, hn::Set(d, 18.714973875f));
  VF tanh_abs = hn::IfThenElse(saturated, hn::Set(d, 1.0f), hn::Mul(y, r));
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
  tanh_abs = hn::IfThenElse(hn::IsNaN(a), a, tanh_abs);  // Highway's portable Min drops a NaN
#endif
  if constexpr (kWithSlope) {
    // 4 r ((y + 1) r): neither (y + 2)^2 nor r^2 leaves fp32's range where y is large.
    *slope = hn::Mul(hn::Mul(hn::Set(d, 4.0f * t.scale), r), hn::Mul(hn::Add(y, hn::Set(d, 1.0f)), r));
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
    *slope = hn::IfThenElse(hn::IsNaN(a), a, *slope);
#endif
  }
  return hn::Mul(hn::Set(d, t.cap), hn::Xor(tanh_abs, sign));
}

template <int kKind>
HWY_INLINE VF Transform(DF d, VF x, const TransformParams& t) {
  if constexpr (kKind == kIdentity) {
    return x;
  } else if constexpr (kKind == kScaled) {
    return hn::Mul(x, hn::Set(d, t.scale));
  } else {
    return SoftCap<false>(d, x, t, nullptr);
  }
}

// z and dz/dx at the logit x.
template <int kKind>
HWY_INLINE VF TransformWithSlope(DF d, VF x, const TransformParams& t, VF* slope) {
  if constexpr (kKind == kSoftCapped) {
    return SoftCap<true>(d, x, t, slope);
  } else {
    *slope = hn::Set(d, t.scale);
    return Transform<kKind>(d, x, t);
  }
}

// ---- the max of bf16 and fp16 logits on their bit patterns --------------------------------

// The max of groups * 4 * lanes bf16 or fp16 values at p (2 * lanes per 16-bit vector), read
// as signed 16-bit integers: one integer max per 2 * lanes logits, no widening. Sign and
// magnitude order them: among patterns with the sign clear (+0 up to +inf, then NaN) the
// integer order is the values' order, and every one of them exceeds every pattern with the
// sign set; so when the largest integer has the sign clear it is the max (or a NaN, which
// then becomes the max and reaches the sums), and when it has the sign set every value is
// negative and the max is the smallest magnitude, the smallest integer (a second pass; a
// NaN with the sign set has the largest magnitude and is never picked unless all are NaN).
// Returns the groups read (all of them); *max the max as fp32, -inf for none.
#if HWY_TARGET != HWY_SCALAR
template <class T>
int64_t RawMax16(const T* p, int64_t groups, float* max) {
  const hn::Repartition<int16_t, DF> d16;
  const auto lanes16 = static_cast<int64_t>(hn::Lanes(d16));
  const auto* bits = reinterpret_cast<const int16_t*>(p);
  auto decode = [](int16_t pattern) {
    T value;
    std::memcpy(&value, &pattern, sizeof(value));
    return to_float(value);
  };
  if (groups == 0) return 0;
  const auto lowest = hn::Set(d16, std::numeric_limits<int16_t>::min());
  auto max0 = lowest, max1 = lowest;
  for (int64_t g = 0; g < groups; ++g) {
    max0 = hn::Max(max0, hn::LoadU(d16, bits + 2 * g * lanes16));
    max1 = hn::Max(max1, hn::LoadU(d16, bits + (2 * g + 1) * lanes16));
  }
  const int16_t top = hn::GetLane(hn::MaxOfLanes(d16, hn::Max(max0, max1)));
  if (top >= 0) {
    *max = decode(top);
    return groups;
  }
  const auto highest = hn::Set(d16, std::numeric_limits<int16_t>::max());
  auto min0 = highest, min1 = highest;
  for (int64_t g = 0; g < groups; ++g) {
    min0 = hn::Min(min0, hn::LoadU(d16, bits + 2 * g * lanes16));
    min1 = hn::Min(min1, hn::LoadU(d16, bits + (2 * g + 1) * lanes16));
  }
  *max = decode(hn::GetLane(hn::MinOfLanes(d16, hn::Min(min0, min1))));
  return groups;
}
#endif

// ---- block statistics ---------------------------------------------------------------------

// The lanes' sums of logits relative to the max are kept times 2^-32: a chunk's 4096 offsets
// then fit fp32's range whatever the logits (offsets up to 6.8e38).
constexpr float kLogitSumScale = 0x1p-32f;

// The forward's lanes of exponentials fold into their fp64 sum every this many vectors.
constexpr int64_t kFoldVectors = 32;

// row: [cols] of T -> BlockStats, a chunk of 256 vectors (in L1) at a time: the chunk's max,
// then the sum of e^(z - m) with m the max so far (as 2^(z L - c), see ExpShifted), the
// earlier chunks' fp64 sum rescaled when m grows (rarely, after the first chunks). Each
// exponent is exact before its one rounding, and the block is read from memory once, with
// no store. (The argmax and the weighted sum take the two-pass
// route below.)
template <class T, int kKind>
void StatsByChunks(const T* row, int64_t cols, const TransformParams& t, bool with_sum_logits, BlockStats* out) {
  // bf16 and fp16 logits, untransformed: the max pass on their 16-bit patterns (RawMax16).
  constexpr bool kRawMax = kKind == kIdentity && !std::is_same_v<T, float> && HWY_TARGET != HWY_SCALAR;
  const DF d;
  const ShiftedPolynomial<std::is_same_v<T, float> ? ExpPrecision::kFull : ExpPrecision::kSums> poly(d);
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  // 256 vectors: the per-chunk work (the max's and the sums' reductions across lanes) comes
  // to 0.17 vector operations per 16 logits (0.6 with 64); eight accumulators keep each
  // lane's fp32 sum of exponentials at about 32 terms, as 64 vectors over two did (and four
  // keep the logits' sums at 32 pairs, as one did).
  const int64_t chunk = 256 * lanes;
  // The sums' prefetches, 8 KiB ahead: the next chunk of bf16 or fp16 as they pass this one
  // (forward 22-27 % faster than 4 KiB, measured; fp32 stays at 8 KiB, 5 % slower at 16).
  constexpr auto ahead = static_cast<int64_t>(8192 / sizeof(T));
  float max = -std::numeric_limits<float>::infinity();
  LaneShift shift = MakeLaneShift(d, 0.0);  // of max, once there is one
  double sum_exp2 = 0.0;                      // sum e^(z - max) / shift.correction
  double sum_logits = 0.0;                    // sum (z - logit_reference(max))
  for (int64_t begin = 0; begin < cols; begin += chunk) {
    const int64_t end = std::min(cols, begin + chunk);
    const int64_t full_end = end - (end - begin) % lanes;
    const auto tail = static_cast<size_t>(end - full_end);
    const bool has_tail = tail != 0;
    // Lanes past the end hold -inf: they add nothing.
    const VF z_tail =
        has_tail ? hn::IfThenElse(hn::FirstN(d, tail), Transform<kKind>(d, LoadPartial(d, row + full_end, tail), t), neg_inf)
                 : neg_inf;
    // Four independent maxima: one would wait on Max's latency at every vector.
    VF max0 = z_tail, max1 = neg_inf, max2 = neg_inf, max3 = neg_inf;
    int64_t v = begin;
    float raw_max = -std::numeric_limits<float>::infinity();
#if HWY_TARGET != HWY_SCALAR
    if constexpr (kRawMax) {
      v = begin + RawMax16(row + begin, (full_end - begin) / (4 * lanes), &raw_max) * 4 * lanes;
    } else
#endif
    {
      for (; v + 4 * lanes <= full_end; v += 4 * lanes) {
        VF x0, x1, x2, x3;
        LoadTwo(d, row + v, x0, x1);
        LoadTwo(d, row + v + 2 * lanes, x2, x3);
        max0 = hn::Max(max0, Transform<kKind>(d, x0, t));
        max1 = hn::Max(max1, Transform<kKind>(d, x1, t));
        max2 = hn::Max(max2, Transform<kKind>(d, x2, t));
        max3 = hn::Max(max3, Transform<kKind>(d, x3, t));
      }
    }
    float chunk_max = raw_max;
    if (!kRawMax || v < full_end || has_tail) {  // (the raw max took every vector of a whole chunk)
      for (; v < full_end; v += lanes) max0 = hn::Max(max0, Transform<kKind>(d, LoadFull(d, row + v), t));
      const VF vmax = hn::Max(hn::Max(max0, max1), hn::Max(max2, max3));
      const float lanes_max = hn::GetLane(hn::MaxOfLanes(d, vmax));
      if (!kRawMax || !(raw_max > lanes_max || std::isnan(raw_max))) chunk_max = lanes_max;
    }
    // The max grows (a NaN max also lands here, and stays). A chunk whose max is -inf (every
    // element -inf or NaN: x86's MAXPS drops a NaN) keeps the shift it has and is summed
    // like any other: its -inf add 0, its NaN make the sum NaN.
    if (!(chunk_max <= max)) {
      const LaneShift grown = MakeLaneShift(d, chunk_max);
      if (sum_exp2 != 0.0) sum_exp2 *= std::exp2(shift.log2_reference - grown.log2_reference);
      if (with_sum_logits) sum_logits = rebased_logit_sum(sum_logits, begin, max, chunk_max);
      max = chunk_max;
      shift = grown;
    }
    VF sums[8] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
    // sum_exp2 += the accumulators' sum, and they start again from 0.
    auto fold_sums = [&] {
      const VF all = hn::Add(hn::Add(hn::Add(sums[0], sums[1]), hn::Add(sums[2], sums[3])),
                             hn::Add(hn::Add(sums[4], sums[5]), hn::Add(sums[6], sums[7])));
      sum_exp2 += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, all)));
      for (VF& sum : sums) sum = hn::Zero(d);
    };
    VF sums_z[4] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
    // The logits' sum relative to the max (so that it stays small where they are large and
    // close together), scaled by 2^-32 in the lanes (exactly, but for offsets below 2^-94) so
    // that no lane overflows where one logit is huge: a fused multiply-subtract per vector
    // (with label smoothing only; the sum without the max took an addition).
    const VF scale = hn::Set(d, kLogitSumScale);
    const VF reference = hn::Set(d, static_cast<float>(logit_reference(max) * static_cast<double>(kLogitSumScale)));
    // The chunk's sums, with the shift's kind fixed for its loops.
    auto sum_chunk = [&](auto subtract_first) {
      constexpr bool kSubtractFirst = decltype(subtract_first)::value;
      const ShiftLanes lanes_shift = shift.lanes;
      // Two vectors into the accumulators `into` and `into + 1` (and `into / 2` of the logits).
      auto two = [&](int64_t at, int into) {
        hwy::Prefetch(row + at + ahead);  // spread over the exponentials, which leave time
        VF x0, x1;
        LoadTwo(d, row + at, x0, x1);
        const VF z0 = Transform<kKind>(d, x0, t), z1 = Transform<kKind>(d, x1, t);
        sums[into] = hn::Add(sums[into], ExpShiftedAs<kSubtractFirst, true>(d, z0, lanes_shift, poly));
        sums[into + 1] = hn::Add(sums[into + 1], ExpShiftedAs<kSubtractFirst, true>(d, z1, lanes_shift, poly));
        if (with_sum_logits) {
          sums_z[into / 2] =
              hn::Add(sums_z[into / 2], hn::Add(hn::MulSub(z0, scale, reference), hn::MulSub(z1, scale, reference)));
        }
      };
      // The exponentials' lanes fold into the fp64 sum every kFoldVectors vectors (4 terms a
      // lane): summed over a whole chunk (32 a lane), their fp32 roundings had cost the lse up
      // to 3.5 x 2^-24, which the backward's p carries (docs/design.md).
      for (v = begin; v + kFoldVectors * lanes <= full_end;) {
        for (const int64_t fold_end = v + kFoldVectors * lanes; v < fold_end; v += 8 * lanes) {
          two(v, 0);
          two(v + 2 * lanes, 2);
          two(v + 4 * lanes, 4);
          two(v + 6 * lanes, 6);
        }
        fold_sums();
      }
      for (; v + 2 * lanes <= full_end; v += 2 * lanes) two(v, 0);
      VF& sum_e = sums[0];
      VF& sum_z = sums_z[0];
      if (v < full_end) {  // one vector left
        const VF z = Transform<kKind>(d, LoadFull(d, row + v), t);
        sum_e = hn::Add(sum_e, ExpShiftedAs<kSubtractFirst, true>(d, z, lanes_shift, poly));
        sum_z = hn::Add(sum_z, hn::MulSub(z, scale, reference));
      }
      if (has_tail) {
        sum_e = hn::Add(sum_e, ExpShiftedAs<kSubtractFirst, true>(d, z_tail, lanes_shift, poly));
        sum_z = hn::Add(sum_z, hn::IfThenElseZero(hn::FirstN(d, tail), hn::MulSub(z_tail, scale, reference)));
      }
    };
    if (shift.subtract_first) {
      sum_chunk(std::true_type{});
    } else {
      sum_chunk(std::false_type{});
    }
    fold_sums();
    if (with_sum_logits) {
      const VF all_z = hn::Add(hn::Add(sums_z[0], sums_z[1]), hn::Add(sums_z[2], sums_z[3]));
      sum_logits += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, all_z))) / static_cast<double>(kLogitSumScale);
    }
  }
  BlockStats s;
  s.max = max;
  s.sum_exp = sum_exp2 * shift.correction;
  s.sum_logits = sum_logits;
  *out = s;
}

// row: [cols] of T -> BlockStats in two passes while the block is in cache: the first keeps
// the transformed logits z in a stack buffer (64 KiB, in L1/L2) and finds the max, so the
// later passes neither widen nor transform again.
template <class T, int kKind>
void Stats(const T* row, int64_t cols, const TransformParams& t, bool with_sum_logits,
           bool with_weighted, BlockStats* out) {
  if (!with_weighted) return StatsByChunks<T, kKind>(row, cols, t, with_sum_logits, out);
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  const int64_t full = cols - cols % lanes;
  const auto tail = static_cast<size_t>(cols - full);
  HWY_ALIGN float z_block[kBlockColumns + kMaxLanes];

  VF vmax = neg_inf;
  for (int64_t v = 0; v < full; v += lanes) {
    const VF z = Transform<kKind>(d, LoadFull(d, row + v), t);
    hn::Store(z, d, z_block + v);
    vmax = hn::Max(vmax, z);
  }
  if (tail != 0) {  // lanes past the end hold -inf: they add nothing below
    const VF z = hn::IfThenElse(hn::FirstN(d, tail), Transform<kKind>(d, LoadPartial(d, row + full, tail), t), neg_inf);
    hn::Store(z, d, z_block + full);
    vmax = hn::Max(vmax, z);
  }
  const int64_t padded = full + (tail != 0 ? lanes : 0);
  BlockStats s;
  s.max = hn::GetLane(hn::MaxOfLanes(d, vmax));
  if (s.max == -std::numeric_limits<float>::infinity()) {  // every element -inf or NaN
    bool any_nan = false;
    for (int64_t v = 0; v < padded; v += lanes) any_nan |= !hn::AllFalse(d, hn::IsNaN(hn::Load(d, z_block + v)));
    const double nan = std::numeric_limits<double>::quiet_NaN();
    s.sum_exp = any_nan ? nan : 0.0;  // no mass, or a NaN that must reach the loss
    s.weighted = any_nan ? nan : 0.0;
    s.sum_logits = !with_sum_logits || cols == 0 ? 0.0 : any_nan ? nan : -std::numeric_limits<double>::infinity();
    *out = s;
    return;
  }
  const VF vm = hn::Set(d, s.max);
  const VF vm_scaled = hn::Set(d, static_cast<float>(static_cast<double>(s.max) * static_cast<double>(kLogitSumScale)));
  if (with_weighted) {  // the first column holding the max
    for (int64_t v = 0; v < padded && s.argmax < 0; v += lanes) {
      const intptr_t lane = hn::FindFirstTrue(d, hn::Eq(hn::Load(d, z_block + v), vm));
      if (lane >= 0) s.argmax = v + lane;
    }
  }
  const LaneShift shift = MakeLaneShift(d, s.max);
  const int64_t chunk = 64 * lanes;
  for (int64_t begin = 0; begin < padded; begin += chunk) {
    const int64_t end = std::min(padded, begin + chunk);
    VF sum_exp = hn::Zero(d), sum_z = hn::Zero(d), weighted = hn::Zero(d);
    for (int64_t v = begin; v < end; v += lanes) {
      // While this block is in cache, bring in the next one (the rest of the row, or the
      // next row): its first pass then overlaps this pass's exponentials.
      hwy::Prefetch(row + v + kBlockColumns);
      const VF z = hn::Load(d, z_block + v);
      const VF offset = hn::Sub(z, vm);
      const VF e = ExpShifted(d, z, shift);  // e^offset / shift.correction
      sum_exp = hn::Add(sum_exp, e);
      if (with_sum_logits) {  // relative to the max and scaled, as in StatsByChunks
        const VF scaled = hn::MulSub(z, hn::Set(d, kLogitSumScale), vm_scaled);
        sum_z = hn::Add(sum_z, v < full ? scaled : hn::IfThenElseZero(hn::FirstN(d, tail), scaled));
      }
      if (with_weighted) {
        weighted = hn::Add(weighted, hn::IfThenElseZero(hn::Gt(e, hn::Zero(d)), hn::Mul(e, offset)));
      }
    }
    s.sum_exp += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, sum_exp)));
    if (with_sum_logits) {
      s.sum_logits += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, sum_z))) / static_cast<double>(kLogitSumScale);
    }
    if (with_weighted) s.weighted += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, weighted)));
  }
  s.sum_exp *= shift.correction;
  s.weighted *= shift.correction;
  *out = s;
}

template <class T>
void StatsForType(const void* row, int64_t cols, const TransformParams& t, bool with_sum_logits,
                  bool with_weighted, BlockStats* out) {
  const T* r = static_cast<const T*>(row);
  if (t.cap > 0.0f) {
    Stats<T, kSoftCapped>(r, cols, t, with_sum_logits, with_weighted, out);
  } else if (t.scale != 1.0f) {
    Stats<T, kScaled>(r, cols, t, with_sum_logits, with_weighted, out);
  } else {
    Stats<T, kIdentity>(r, cols, t, with_sum_logits, with_weighted, out);
  }
}

void BlockStatsImpl(const void* row, int32_t type, int64_t cols, const TransformParams& t,
                    bool with_sum_logits, bool with_weighted, BlockStats* out) {
  switch (static_cast<StorageType>(type)) {
    case StorageType::kFloat32: return StatsForType<float>(row, cols, t, with_sum_logits, with_weighted, out);
    case StorageType::kBFloat16: return StatsForType<BFloat16>(row, cols, t, with_sum_logits, with_weighted, out);
    case StorageType::kFloat16: return StatsForType<Float16>(row, cols, t, with_sum_logits, with_weighted, out);
  }
}

// ---- block gradient -----------------------------------------------------------------------

// One full vector of gradient; kHardwareBf16 rounds a bf16 one with VCVTNEPS2BF16.
template <bool kHardwareBf16, class G>
HWY_INLINE void StoreGradient(DF d, VF v, G* p) {
#if HWY_TARGET == HWY_AVX3
  if constexpr (kHardwareBf16) return StoreBf16Hardware(v, p);
#endif
  StoreFull(d, v, p);
}

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
// kHardwareBf16: full vectors of a bf16 gradient are rounded by VCVTNEPS2BF16 (AVX3 only).
// kFolded: no uniform term (u = 0), so the gradient is k e^(z - m), and k rides in the exp's
// polynomial (ExpPolynomial).
// kBinade (AVX3, bf16 in and out, kFolded, no AVX512-BF16): the gradient rounded to bf16
// inside the exp with `binade_shift`, the caller's valid BinadeShift of m and its factor.
template <class T, class G, int kKind, bool kHardwareBf16, bool kFolded, bool kBinade = false>
void GradientLoop(const T* row, G* grad, int64_t cols, const TransformParams& t, const LaneShift& shift, double k,
                  float u, [[maybe_unused]] const BinadeShift* binade_shift = nullptr) {
  static_assert(!kBinade || (kFolded && !kHardwareBf16 && kKind == kIdentity && std::is_same_v<T, BFloat16> &&
                             std::is_same_v<G, BFloat16> && HWY_TARGET == HWY_AVX3));
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
#if HWY_TARGET == HWY_AVX3
  BinadeShift binade{};
  if constexpr (kBinade) binade = *binade_shift;
#endif
  // The shift's value and kind as locals, so that they stay in registers across the loops'
  // stores (after the fp16 store's asm the compiler would read a struct's fields again).
  const ShiftLanes lanes_shift = shift.lanes;
  const bool subtract_first = shift.subtract_first;
  const VF scaled_coefficient = hn::Set(d, static_cast<float>(k));
  const VF scaled_uniform = hn::Set(d, u);
  // Every gradient takes the full exp, also one rounded to bf16 or fp16 afterwards: a
  // cheaper exp's error, though within one unit of the dtype, leans one way and takes a
  // rounding the wrong way a hundred times as often (docs/design.md).
  const ShiftedPolynomial<ExpPrecision::kFull, kFolded> poly(d, kFolded ? k : 1.0);
  auto element = [&](VF x) {
    VF slope;
    const VF z = TransformWithSlope<kKind>(d, x, t, &slope);
    VF g;
    if constexpr (kBinade) {
#if HWY_TARGET == HWY_AVX3
      g = ExpShiftedBf16(d, z, binade, poly);
#endif
    } else {
      // (z is at most lse, or 88 above a wrong one, given to the staged API)
      g = HWY_UNLIKELY(subtract_first) ? ExpShiftedAs<true, false, true>(d, z, lanes_shift, poly)
                                       : ExpShiftedAs<false, false, true>(d, z, lanes_shift, poly);
      if constexpr (!kFolded) g = hn::MulSub(g, scaled_coefficient, scaled_uniform);
    }
    if constexpr (kKind != kIdentity) g = hn::Mul(g, slope);
    return g;
  };
  constexpr int64_t kAhead = 1024;  // elements prefetched ahead of the loads
  int64_t v = 0;
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
    if (peel > 0) StorePartial(d, element(LoadPartial(d, row, static_cast<size_t>(peel))), grad, static_cast<size_t>(peel));
    v = peel;
    for (; v + lanes <= cols; v += lanes) {
      hwy::Prefetch(row + v + kAhead);
      if constexpr (std::is_same_v<G, float>) hn::Stream(element(LoadFull(d, row + v)), d, grad + v);
    }
    hwy::FlushStream();
  } else {
#if HWY_TARGET == HWY_AVX3
    if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<G, BFloat16>) {  // bf16 pairs in and out
      for (; v + 2 * lanes <= cols; v += 2 * lanes) {
        hwy::Prefetch(row + v + kAhead);
        VF even, odd;
        LoadTwo(d, row + v, even, odd);
        if constexpr (kHardwareBf16) {
          StoreBf16PairsHardware(element(even), element(odd), grad + v);
        } else if constexpr (kBinade) {
          StoreBf16PairsRounded(element(even), element(odd), grad + v);
        } else {
          StoreBf16PairsSoftware(element(even), element(odd), grad + v);
        }
      }
    }
#else
    // bf16 pairs in and out, rounded in the FPU where every gradient is below 2^111.
    if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<G, BFloat16>) {
      const double largest = (std::fabs(k) + static_cast<double>(std::fabs(u))) * std::fabs(static_cast<double>(t.scale));
      if (largest < 0x1p110) {
        for (; v + 2 * lanes <= cols; v += 2 * lanes) {
          hwy::Prefetch(row + v + kAhead);
          VF even, odd;
          LoadTwo(d, row + v, even, odd);
          StoreBf16PairsNearest(d, element(even), element(odd), grad + v);
        }
      }
    }
#endif
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
//   With FMA, elsewhere than AVX-512 (kExactArgument), the lanes take e^(z - lse) with z
//   itself as the exponential's argument (ExponentialScaled), so the result's error does not
//   grow with |z - lse|.
//   AVX-512 (Exp2: t = z log2(e) - c, whose rounding grows with |z - s|) and the targets
//   without FMA shift by the block's max m instead of lse, e^(z - m) e^(m - lse): a pass over
//   the block for its max (which then stays in cache for the next), the argument's rounding
//   2^-24 |z - m| relative, no larger than in Megatron's exp(z - max), where |z - lse|
//   exceeds |z - max| by up to log Vv.
template <class T, class G, int kKind, bool kHardwareBf16>
void GradientForKind(const T* row, G* grad, int64_t cols, const TransformParams& t, const GradientConstants& c) {
  const DF d;
  const double upstream = c.exact_upstream * c.z_loss_factor;
  const auto u = static_cast<float>(c.exact_upstream * c.exact_uniform);
  if constexpr (kExactArgument) {
    const LaneShift shift = MakeLaneShift(d, c.exact_lse);
    const double k = upstream * shift.correction;
    if (u == 0.0f && Foldable(k)) {
      return GradientLoop<T, G, kKind, kHardwareBf16, true>(row, grad, cols, t, shift, k, 0.0f);
    }
    return GradientLoop<T, G, kKind, kHardwareBf16, false>(row, grad, cols, t, shift, k, u);
  } else {
    const float max = BlockMax<T, kKind>(row, cols, t);
    // A block of -inf (every p 0) takes the shift 0, where e^(-inf - 0) is 0.
    const float m = max == -std::numeric_limits<float>::infinity() ? 0.0f : max;
    const LaneShift shift = MakeLaneShift(d, m);
    // (0 for a block of -inf, NaN for a row whose lse is NaN or +inf, or -inf)
    const double factor = upstream * std::exp(static_cast<double>(max) - c.exact_lse);
    const double k = factor * shift.correction;
    if (u == 0.0f && Foldable(k)) {
#if HWY_TARGET == HWY_AVX3
      if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<G, BFloat16> && !kHardwareBf16 &&
                    kKind == kIdentity) {
        if (const BinadeShift binade = MakeBinadeShift(d, m, factor); binade.valid) {
          return GradientLoop<T, G, kKind, false, true, true>(row, grad, cols, t, binade.shift, binade.coefficient,
                                                              0.0f, &binade);
        }
      }
#endif
      return GradientLoop<T, G, kKind, kHardwareBf16, true>(row, grad, cols, t, shift, k, 0.0f);
    }
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
void GradientForTypes(const void* row, void* grad, int64_t cols, const TransformParams& t,
                      const GradientConstants& c) {
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
  switch (static_cast<StorageType>(out)) {
    case StorageType::kFloat32: return GradientForTypes<T, float>(row, grad, cols, t, c);
    case StorageType::kBFloat16: return GradientForTypes<T, BFloat16>(row, grad, cols, t, c);
    case StorageType::kFloat16: return GradientForTypes<T, Float16>(row, grad, cols, t, c);
  }
}

void BlockGradientImpl(const void* row, int32_t in, void* grad, int32_t out, int64_t cols,
                       const TransformParams& t, const GradientConstants& c) {
  switch (static_cast<StorageType>(in)) {
    case StorageType::kFloat32: return GradientForInput<float>(row, out, grad, cols, t, c);
    case StorageType::kBFloat16: return GradientForInput<BFloat16>(row, out, grad, cols, t, c);
    case StorageType::kFloat16: return GradientForInput<Float16>(row, out, grad, cols, t, c);
  }
}

// ---- whole rows, for the composable row kernels (vpce/rows.h) -------------------------------

// row: [cols] of T -> its max (NaN when an element is NaN, as torch.max gives; -inf for no
// column), and the row widened to fp32 into `widened` when it is not null, in one read.
template <class T>
float RowMax(const T* row, int64_t cols, float* widened) {
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  VF max0 = neg_inf, max1 = neg_inf;
  auto nan = hn::IsNaN(neg_inf);  // no lane
  int64_t v = 0;
  for (; v + 2 * lanes <= cols; v += 2 * lanes) {
    const VF x0 = LoadFull(d, row + v), x1 = LoadFull(d, row + v + lanes);
    if (widened != nullptr) {
      hn::StoreU(x0, d, widened + v);
      hn::StoreU(x1, d, widened + v + lanes);
    }
    max0 = hn::Max(max0, x0);
    max1 = hn::Max(max1, x1);
    nan = hn::Or(nan, hn::Or(hn::IsNaN(x0), hn::IsNaN(x1)));
  }
  for (; v < cols; v += lanes) {
    const auto count = static_cast<size_t>(std::min(lanes, cols - v));
    const VF x = hn::IfThenElse(hn::FirstN(d, count), LoadPartial(d, row + v, count), neg_inf);
    if (widened != nullptr) StorePartial(d, x, widened + v, count);
    max0 = hn::Max(max0, x);
    nan = hn::Or(nan, hn::IsNaN(x));
  }
  if (!hn::AllFalse(d, nan)) return std::numeric_limits<float>::quiet_NaN();
  return hn::GetLane(hn::MaxOfLanes(d, hn::Max(max0, max1)));
}

float RowMaxImpl(const void* row, int32_t type, int64_t cols, float* widened) {
  switch (static_cast<StorageType>(type)) {
    case StorageType::kFloat32: return RowMax(static_cast<const float*>(row), cols, widened);
    case StorageType::kBFloat16: return RowMax(static_cast<const BFloat16*>(row), cols, widened);
    case StorageType::kFloat16: return RowMax(static_cast<const Float16*>(row), cols, widened);
  }
  return 0.0f;
}

// row: [cols] fp32, in place: row[v] <- exp(row[v] - shift), the difference rounded to fp32
// first (as `x -= max` then `exp` would), the exp the Cody-Waite one on every target;
// returns the sum of the new values, in fp32 lanes over a chunk of 64 vectors and fp64
// across chunks.
double ExpRowInPlaceImpl(float* row, int64_t cols, float shift) {
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF s = hn::Set(d, shift);
  const int64_t chunk = 64 * lanes;
  double total = 0.0;
  for (int64_t begin = 0; begin < cols; begin += chunk) {
    const int64_t end = std::min(cols, begin + chunk);
    VF sum0 = hn::Zero(d), sum1 = hn::Zero(d);
    int64_t v = begin;
    for (; v + 2 * lanes <= end; v += 2 * lanes) {
      const VF y0 = Exponential(d, hn::Sub(hn::LoadU(d, row + v), s));
      const VF y1 = Exponential(d, hn::Sub(hn::LoadU(d, row + v + lanes), s));
      hn::StoreU(y0, d, row + v);
      hn::StoreU(y1, d, row + v + lanes);
      sum0 = hn::Add(sum0, y0);
      sum1 = hn::Add(sum1, y1);
    }
    for (; v < end; v += lanes) {
      const auto count = static_cast<size_t>(std::min(lanes, end - v));
      const VF y = Exponential(d, hn::Sub(LoadPartial(d, row + v, count), s));
      StorePartial(d, y, row + v, count);
      sum0 = hn::Add(sum0, hn::IfThenElseZero(hn::FirstN(d, count), y));
    }
    total += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, hn::Add(sum0, sum1))));
  }
  return total;
}

// ---- single values, with the blocks' arithmetic ---------------------------------------------

float TransformOneImpl(float x, const TransformParams& t) {
  const DF d;
  const VF v = hn::Set(d, x);
  if (t.cap > 0.0f) return hn::GetLane(Transform<kSoftCapped>(d, v, t));
  if (t.scale != 1.0f) return hn::GetLane(Transform<kScaled>(d, v, t));
  return x;
}

float SlopeOneImpl(float x, const TransformParams& t) {
  const DF d;
  if (t.cap > 0.0f) {
    VF slope;
    TransformWithSlope<kSoftCapped>(d, hn::Set(d, x), t, &slope);
    return hn::GetLane(slope);
  }
  return t.scale;
}

float ExpShiftedOneImpl(float x, float s) {
  const DF d;
  const LaneShift shift = MakeLaneShift(d, s);
  return hn::GetLane(
      ExpShifted(d, hn::Set(d, x), shift, ShiftedPolynomial<ExpPrecision::kFull, true>(d, shift.correction)));
}

void ExpShiftedImpl(const float* x, float s, float* y, int64_t n) {
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const LaneShift shift = MakeLaneShift(d, s);
  // The correction in the polynomial, as the gradients fold their factor (with s = 0, as
  // for the bound's exp, there is none: the plain polynomial, the same bits).
  auto run = [&](const auto& poly) {
    int64_t v = 0;
    for (; v + lanes <= n; v += lanes) hn::StoreU(ExpShifted(d, hn::LoadU(d, x + v), shift, poly), d, y + v);
    if (v < n) {  // the last partial vector, with the same arithmetic
      const auto tail = static_cast<size_t>(n - v);
      StorePartial(d, ExpShifted(d, LoadPartial(d, x + v, tail), shift, poly), y + v, tail);
    }
  };
  if (shift.correction == 1.0) return run(ShiftedPolynomial<ExpPrecision::kFull>(d));
  run(ShiftedPolynomial<ExpPrecision::kFull, true>(d, shift.correction));
}

// x: [n] fp32 -> out: [n] of `type`, through the kernels' stores of a gradient (full vectors
// as the gradient loops write them, the last partial one as theirs).
// x: [n] fp32 -> out: [n] bf16 through the in-place bf16 gradient's pair stores (the even and
// the odd positions of each 2 * lanes as two vectors), the last elements through
// StorePartial; |x| below 2^110, or NaN or inf.
void StoreBf16PairsImpl(const float* x, BFloat16* out, int64_t n) {
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  float even[kMaxLanes], odd[kMaxLanes];
  int64_t v = 0;
  for (; v + 2 * lanes <= n; v += 2 * lanes) {
    for (int64_t i = 0; i < lanes; ++i) even[i] = x[v + 2 * i], odd[i] = x[v + 2 * i + 1];
    const VF e = hn::LoadU(d, even), o = hn::LoadU(d, odd);
#if HWY_TARGET == HWY_AVX3
    if (HasAvx512Bf16()) {
      StoreBf16PairsHardware(e, o, out + v);
    } else {
      StoreBf16PairsSoftware(e, o, out + v);
    }
#else
    StoreBf16PairsNearest(d, e, o, out + v);
#endif
  }
  for (; v < n; v += lanes) {
    const auto count = static_cast<size_t>(std::min(lanes, n - v));
    StorePartial(d, LoadPartial(d, x + v, count), out + v, count);
  }
}

void StoreLanesImpl(const float* x, int32_t type, void* out, int64_t n) {
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  auto store = [&](auto* typed) {
    int64_t v = 0;
    for (; v + lanes <= n; v += lanes) {
#if HWY_TARGET == HWY_AVX3
      if constexpr (std::is_same_v<std::remove_pointer_t<decltype(typed)>, BFloat16>) {
        if (HasAvx512Bf16()) {
          StoreGradient<true>(d, hn::LoadU(d, x + v), typed + v);
          continue;
        }
      }
#endif
      StoreGradient<false>(d, hn::LoadU(d, x + v), typed + v);
    }
    if (v < n) StorePartial(d, LoadPartial(d, x + v, static_cast<size_t>(n - v)), typed + v, static_cast<size_t>(n - v));
  };
  switch (static_cast<StorageType>(type)) {
    case StorageType::kFloat32: return store(static_cast<float*>(out));
    case StorageType::kBFloat16: return store(static_cast<BFloat16*>(out));
    case StorageType::kFloat16: return store(static_cast<Float16*>(out));
  }
}

void StreamCopyImpl(void* destination, const void* source, int64_t bytes) {
  const hn::ScalableTag<uint8_t> d8;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d8));
  auto* to = static_cast<uint8_t*>(destination);
  const auto* from = static_cast<const uint8_t*>(source);
  const auto misalignment = static_cast<int64_t>(reinterpret_cast<uintptr_t>(to) % static_cast<uintptr_t>(lanes));
  const int64_t head = std::min(bytes, misalignment == 0 ? int64_t{0} : lanes - misalignment);
  std::memcpy(to, from, static_cast<size_t>(head));
  int64_t i = head;
  for (; i + lanes <= bytes; i += lanes) hn::Stream(hn::LoadU(d8, from + i), d8, to + i);
  hwy::FlushStream();
  std::memcpy(to + i, from + i, static_cast<size_t>(bytes - i));
}

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }
bool ExpArgumentIsExactImpl() { return kExactArgument; }

}  // namespace HWY_NAMESPACE
}  // namespace vpce::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace vpce::detail {

namespace {
std::atomic<bool> g_bf16_instructions_allowed{true};
std::atomic<bool> g_streaming_stores_allowed{true};
}  // namespace

void set_bf16_instructions_allowed(bool allowed) { g_bf16_instructions_allowed.store(allowed); }
bool bf16_instructions_allowed() { return g_bf16_instructions_allowed.load(std::memory_order_relaxed); }
void set_streaming_stores_allowed(bool allowed) { g_streaming_stores_allowed.store(allowed); }
bool streaming_stores_allowed() { return g_streaming_stores_allowed.load(std::memory_order_relaxed); }
bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

HWY_EXPORT(BlockStatsImpl);
HWY_EXPORT(BlockGradientImpl);
HWY_EXPORT(TransformOneImpl);
HWY_EXPORT(SlopeOneImpl);
HWY_EXPORT(ExpShiftedOneImpl);
HWY_EXPORT(ExpShiftedImpl);
HWY_EXPORT(StoreLanesImpl);
HWY_EXPORT(StoreBf16PairsImpl);
HWY_EXPORT(StreamCopyImpl);
HWY_EXPORT(RowMaxImpl);
HWY_EXPORT(ExpRowInPlaceImpl);
HWY_EXPORT(TargetNameImpl);
HWY_EXPORT(ExpArgumentIsExactImpl);

void fold_block(BlockStats& a, const BlockStats& b, int64_t offset) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // No mass: every element -inf (a NaN element leaves max at -inf but the sum NaN, and that
  // NaN must reach the loss).
  auto empty = [](const BlockStats& s) { return s.max == kNegInf && !std::isnan(s.sum_exp); };
  // The sums of logits, each relative to its own max, rebased to the folded one.
  auto fold_sums = [&](float max) {
    return rebased_logit_sum(a.sum_logits, a.columns, a.max, max) +
           rebased_logit_sum(b.sum_logits, b.columns, b.max, max);
  };
  const int64_t columns = a.columns + b.columns;
  if (empty(b)) {  // adds no mass (and -inf - -inf would be NaN)
    a.sum_logits = fold_sums(a.max);
    a.columns = columns;
    return;
  }
  if (empty(a)) {
    const double sum_logits = fold_sums(b.max);
    a = b;
    a.sum_logits = sum_logits;
    a.columns = columns;
    if (a.argmax >= 0) a.argmax += offset;
    return;
  }
  const float max = std::max(a.max, b.max);
  a.sum_logits = fold_sums(max);
  a.columns = columns;
  const double shift_a = static_cast<double>(a.max) - static_cast<double>(max);
  const double shift_b = static_cast<double>(b.max) - static_cast<double>(max);
  const double scale_a = std::exp(shift_a), scale_b = std::exp(shift_b);
  // sum exp(z - M)(z - M) = e^shift (sum exp(z - m)(z - m) + shift sum exp(z - m))
  a.weighted = scale_a * (a.weighted + shift_a * a.sum_exp) + scale_b * (b.weighted + shift_b * b.sum_exp);
  a.sum_exp = a.sum_exp * scale_a + b.sum_exp * scale_b;
  if (b.max > a.max && b.argmax >= 0) a.argmax = b.argmax + offset;  // ties keep the earlier column
  a.max = max;
}

BlockStats block_stats(const void* row, StorageType type, int64_t cols, const TransformParams& t,
                       bool with_sum_logits, bool with_weighted) {
  BlockStats out;
  HWY_DYNAMIC_DISPATCH(BlockStatsImpl)(row, static_cast<int32_t>(type), cols, t, with_sum_logits, with_weighted, &out);
  out.columns = cols;
  return out;
}

void block_gradient(const void* row, StorageType in, void* grad, StorageType out, int64_t cols,
                    const TransformParams& t, const GradientConstants& c) {
  HWY_DYNAMIC_DISPATCH(BlockGradientImpl)(row, static_cast<int32_t>(in), grad, static_cast<int32_t>(out), cols, t, c);
}

float transform_one(float x, const TransformParams& t) { return HWY_DYNAMIC_DISPATCH(TransformOneImpl)(x, t); }
float slope_one(float x, const TransformParams& t) { return HWY_DYNAMIC_DISPATCH(SlopeOneImpl)(x, t); }
float exp_shifted_one(float x, float s) { return HWY_DYNAMIC_DISPATCH(ExpShiftedOneImpl)(x, s); }
void exp_shifted_lanes(const float* x, float s, float* y, int64_t n) {
  HWY_DYNAMIC_DISPATCH(ExpShiftedImpl)(x, s, y, n);
}
void store_lanes(const float* x, StorageType type, void* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(StoreLanesImpl)(x, static_cast<int32_t>(type), out, n);
}
void store_bf16_pairs(const float* x, uint16_t* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(StoreBf16PairsImpl)(x, reinterpret_cast<BFloat16*>(out), n);
}
void stream_copy(void* destination, const void* source, int64_t bytes) {
  HWY_DYNAMIC_DISPATCH(StreamCopyImpl)(destination, source, bytes);
}
const char* simd_target_name() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }
bool exp_argument_is_exact() { return HWY_DYNAMIC_DISPATCH(ExpArgumentIsExactImpl)(); }
float row_max(const void* row, StorageType type, int64_t cols, float* widened) {
  return HWY_DYNAMIC_DISPATCH(RowMaxImpl)(row, static_cast<int32_t>(type), cols, widened);
}
double exp_row_in_place(float* row, int64_t cols, float shift) {
  return HWY_DYNAMIC_DISPATCH(ExpRowInPlaceImpl)(row, cols, shift);
}

}  // namespace vpce::detail
#endif  // HWY_ONCE
