// cpu/simd/transform-inl.h: the logit transform of the SIMD kernels: the scale and the soft
// cap (z = cap tanh(scale x / cap)), with its slope for the gradient.
// A Highway per-target header: included by each src/cpu/simd_*.cc after
// <hwy/foreach_target.h>, once per target (the guard toggles with HWY_TARGET_TOGGLE).
#if defined(VPCE_CPU_SIMD_TRANSFORM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef VPCE_CPU_SIMD_TRANSFORM_INL_H_
#undef VPCE_CPU_SIMD_TRANSFORM_INL_H_
#else
#define VPCE_CPU_SIMD_TRANSFORM_INL_H_
#endif

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include "cpu/simd/vectors-inl.h"

HWY_BEFORE_NAMESPACE();
namespace vpce::detail {
namespace HWY_NAMESPACE {

// ---- the logit transform ----------------------------------------------------------------

// The soft cap's z = cap tanh(a), a = scale x / cap, and, with `slope`, dz/dx = slope_scale (1 -
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
    *slope = hn::Mul(hn::Mul(hn::Set(d, 4.0f * t.slope_scale), r), hn::Mul(hn::Add(y, hn::Set(d, 1.0f)), r));
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

}  // namespace HWY_NAMESPACE
}  // namespace vpce::detail
HWY_AFTER_NAMESPACE();

#endif  // VPCE_CPU_SIMD_TRANSFORM_INL_H_
