// cpu/simd/vectors-inl.h: the SIMD kernels' vectors: the fp32 vector type, loads that widen
// bf16 and fp16, stores that round to them (to nearest even: AVX512-BF16, or in software),
// and the max of 16-bit logits on their bit patterns.
// A Highway per-target header: included by each src/cpu/simd_*.cc after
// <hwy/foreach_target.h>, once per target (the guard toggles with HWY_TARGET_TOGGLE).
#if defined(VPCE_CPU_SIMD_VECTORS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef VPCE_CPU_SIMD_VECTORS_INL_H_
#undef VPCE_CPU_SIMD_VECTORS_INL_H_
#else
#define VPCE_CPU_SIMD_VECTORS_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
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

// f(tag) with tag a null pointer to the storage type `type` names (float, BFloat16 or
// Float16): the one switch from a run-time dtype to the kernels' templates.
template <class F>
decltype(auto) WithStorageType(int32_t type, F&& f) {
  switch (static_cast<StorageType>(type)) {
    case StorageType::kBFloat16: return f(static_cast<BFloat16*>(nullptr));
    case StorageType::kFloat16: return f(static_cast<Float16*>(nullptr));
    case StorageType::kFloat32: break;
  }
  return f(static_cast<float*>(nullptr));
}

// The type a WithStorageType tag points to.
template <class Tag>
using TagType = std::remove_pointer_t<Tag>;

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

using VU = hn::Vec<hn::RebindToUnsigned<DF>>;

// 2 * lanes bf16 at p as fp32 lanes of (odd << 16) | even.
HWY_INLINE VU LoadBf16Words(const BFloat16* p) {
  return hn::LoadU(hn::RebindToUnsigned<DF>(), reinterpret_cast<const uint32_t*>(p));
}

// Those words as two vectors of fp32: the even positions' values and the odd ones'.
HWY_INLINE void SplitBf16Words(DF d, VU words, VF& even, VF& odd) {
  const hn::RebindToUnsigned<DF> du;
  even = hn::BitCast(d, hn::ShiftLeft<16>(words));
  odd = hn::BitCast(d, hn::And(words, hn::Set(du, 0xFFFF0000u)));
}

// 2 * lanes consecutive elements as two vectors, in an order that only sums and maxima may
// rely on: bf16 as the even and the odd positions, from one load and two integer
// operations (PromoteTo needs a shuffle and a shift per vector); other types in order.
template <class T>
HWY_INLINE void LoadTwo(DF d, const T* p, VF& first, VF& second) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    SplitBf16Words(d, LoadBf16Words(p), first, second);
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

inline bool HasAvx512Bf16() { return cpu_has_avx512_bf16() && bf16_instructions_allowed(); }
#endif

// Even- and odd-position fp32 values (as LoadTwo gives them) -> 2 * lanes bf16 in order,
// each rounded to nearest in integer arithmetic: half a bf16 unit added to its bits, 0x8000
// at the even positions and 0x7FFF at the odd ones, then the odd values' upper halves and the
// even values' upper halves shifted down, merged by one blend of 16-bit words (VPBLENDW on
// AVX2, VPBLENDMW on AVX-512). A value exactly halfway between two bf16 (rare in a computed
// gradient) goes up at an even position and down at an odd one, so that the ties do not lean
// one way, as rounding half up would; every other value rounds as to nearest even. 4 integer
// vector operations per pair on AVX2 and AVX-512 (about 6 on SSSE3, whose 16-bit blend is a
// mask and a select), none of them on the FPU's arithmetic: where AVX512-BF16's
// VCVTNE2PS2BF16 and the VPERMW that orders its output take 5.4 slots of the FMA ports on
// Intel's cores (bench/port_probe), and AVX2's rounding in the FPU took 8 operations a pair,
// 6 of them floating-point (Veltkamp's splitting). Infinities stay infinite, a value past
// bf16's largest becomes infinite (as to nearest even), subnormals round as normal numbers do,
// zeros keep their sign; a NaN stays NaN where its low 16 bits are 0, as those of bf16
// logits' NaNs and of arithmetic's are (fp32 NaNs with other payloads are not promised: one
// whose upper mantissa bits are 0 would truncate to infinity, and one with all its upper bits
// set and a lower half past the halfway constant would carry into the sign).
HWY_INLINE void StoreBf16PairsHalfway(VF even, VF odd, BFloat16* p) {
  const hn::RebindToUnsigned<DF> du;
  const auto e = hn::Add(hn::BitCast(du, even), hn::Set(du, 0x8000u));
  const auto o = hn::Add(hn::BitCast(du, odd), hn::Set(du, 0x7FFFu));
#if HWY_TARGET == HWY_SCALAR  // (one lane, no 16-bit view of it)
  const auto packed = hn::Or(hn::And(o, hn::Set(du, 0xFFFF0000u)), hn::ShiftRight<16>(e));
  hn::StoreU(packed, du, reinterpret_cast<uint32_t*>(p));
#else
  // The odd 16-bit words (the upper halves) from o, the even ones from e's shifted down.
  const hn::Repartition<uint16_t, DF> du16;
  const auto packed = hn::OddEven(hn::BitCast(du16, o), hn::BitCast(du16, hn::ShiftRight<16>(e)));
  hn::StoreU(packed, du16, reinterpret_cast<uint16_t*>(p));
#endif
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

// ---- block gradient -----------------------------------------------------------------------

// One full vector of gradient; kHardwareBf16 rounds a bf16 one with VCVTNEPS2BF16.
template <bool kHardwareBf16, class G>
HWY_INLINE void StoreGradient(DF d, VF v, G* p) {
#if HWY_TARGET == HWY_AVX3
  if constexpr (kHardwareBf16) return StoreBf16Hardware(v, p);
#endif
  StoreFull(d, v, p);
}

// ---- the max of bf16 and fp16 logits on their bit patterns --------------------------------

#if HWY_TARGET == HWY_AVX2
// Whether no 16-bit pattern in a or b, read as an unsigned integer, exceeds the one that
// `most` holds in both halves of every lane: their integer max less it, saturated at 0, is
// then 0, which one VPTEST sees (3 integer operations for 4 * lanes patterns).
HWY_INLINE bool PatternsAtMost(VU a, VU b, VU most) {
  const hn::Repartition<uint16_t, DF> du16;
  const auto excess = hn::SaturatedSub(hn::Max(hn::BitCast(du16, a), hn::BitCast(du16, b)), hn::BitCast(du16, most));
  return _mm256_testz_si256(excess.raw, excess.raw) != 0;
}
#endif

// The max of groups * 4 * lanes bf16 or fp16 values at p (2 * lanes per 16-bit vector), read
// as signed 16-bit integers: one integer max per 2 * lanes logits, no widening. Sign and
// magnitude order them: among patterns with the sign clear (+0 up to +inf, then NaN) the
// integer order is the values' order, and every one of them exceeds every pattern with the
// sign set; so when the largest integer has the sign clear it is the max (or a NaN, which
// then becomes the max and reaches the sums), and when it has the sign set every value is
// negative and the max is the smallest magnitude, the smallest integer (a second pass; a
// NaN with the sign set has the largest magnitude and is never picked unless all are NaN).
// Returns the groups read (all of them); *max the max as fp32, -inf for none.
// kWithLowest: *lowest too, a bound below every value read: read as unsigned integers, the
// largest pattern with the sign set is the most negative value (or a NaN with the sign set,
// then *lowest is NaN), and with none set every value is at least +0 (one more integer max
// per 2 * lanes logits).
#if HWY_TARGET != HWY_SCALAR
template <class T, bool kWithLowest = false>
int64_t RawMax16(const T* p, int64_t groups, float* max, [[maybe_unused]] float* lowest = nullptr) {
  const hn::Repartition<int16_t, DF> d16;
  const hn::Repartition<uint16_t, DF> du16;
  const auto lanes16 = static_cast<int64_t>(hn::Lanes(d16));
  const auto* bits = reinterpret_cast<const int16_t*>(p);
  auto decode = [](int16_t pattern) {
    T value;
    std::memcpy(&value, &pattern, sizeof(value));
    return to_float(value);
  };
  if (groups == 0) return 0;
  const auto lowest_signed = hn::Set(d16, std::numeric_limits<int16_t>::min());
  auto max0 = lowest_signed, max1 = lowest_signed;
  auto unsigned0 = hn::Zero(du16), unsigned1 = hn::Zero(du16);
  for (int64_t g = 0; g < groups; ++g) {
    const auto first = hn::LoadU(d16, bits + 2 * g * lanes16);
    const auto second = hn::LoadU(d16, bits + (2 * g + 1) * lanes16);
    max0 = hn::Max(max0, first);
    max1 = hn::Max(max1, second);
    if constexpr (kWithLowest) {
      unsigned0 = hn::Max(unsigned0, hn::BitCast(du16, first));
      unsigned1 = hn::Max(unsigned1, hn::BitCast(du16, second));
    }
  }
  if constexpr (kWithLowest) {
    const uint16_t most = hn::GetLane(hn::MaxOfLanes(du16, hn::Max(unsigned0, unsigned1)));
    *lowest = most >= 0x8000 ? decode(static_cast<int16_t>(most)) : 0.0f;
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

}  // namespace HWY_NAMESPACE
}  // namespace vpce::detail
HWY_AFTER_NAMESPACE();

#endif  // VPCE_CPU_SIMD_VECTORS_INL_H_
