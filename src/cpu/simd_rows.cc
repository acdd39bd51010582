// cpu/simd_rows.cc: the SIMD pieces beside the blocks' statistics (simd_stats.cc) and
// gradient (simd_gradient.cc): whole rows for the composable row kernels (vpce/rows.h),
// single values with the blocks' arithmetic, stores of fp32 lanes to every dtype, the
// streaming copy, which target runs, the switches (bf16 instructions, streaming stores) and
// the fold of two blocks' statistics. Google Highway, dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd_rows.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "cpu/simd/exp-inl.h"
#include "cpu/simd/transform-inl.h"
#include "cpu/simd/vectors-inl.h"

HWY_BEFORE_NAMESPACE();
namespace vpce::detail {
namespace HWY_NAMESPACE {

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
  return WithStorageType(
      type, [&](auto* tag) { return RowMax(static_cast<const TagType<decltype(tag)>*>(row), cols, widened); });
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
  return hn::GetLane(ExpShifted(d, hn::Set(d, x), shift, ExpPolynomial<true>(d, shift.correction)));
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
  if (shift.correction == 1.0) return run(ExpPolynomial<>(d));
  run(ExpPolynomial<true>(d, shift.correction));
}

// x: [n] fp32 -> out: [n] bf16 through the in-place bf16 gradient's pair stores (the even and
// the odd positions of each 2 * lanes as two vectors), the last elements through
// StorePartial.
void StoreBf16PairsImpl(const float* x, BFloat16* out, int64_t n) {
  const DF d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  float even[kMaxLanes], odd[kMaxLanes];
  int64_t v = 0;
  for (; v + 2 * lanes <= n; v += 2 * lanes) {
    for (int64_t i = 0; i < lanes; ++i) even[i] = x[v + 2 * i], odd[i] = x[v + 2 * i + 1];
    const VF e = hn::LoadU(d, even), o = hn::LoadU(d, odd);
    StoreBf16PairsHalfway(e, o, out + v);
  }
  for (; v < n; v += lanes) {
    const auto count = static_cast<size_t>(std::min(lanes, n - v));
    StorePartial(d, LoadPartial(d, x + v, count), out + v, count);
  }
}

// x: [n] fp32 -> out: [n] of `type`, through the kernels' stores of a gradient (full vectors
// as the gradient loops write them, the last partial one as theirs).
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
    if (v < n)
      StorePartial(d, LoadPartial(d, x + v, static_cast<size_t>(n - v)), typed + v, static_cast<size_t>(n - v));
  };
  WithStorageType(type, [&](auto* tag) { store(static_cast<decltype(tag)>(out)); });
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
  a.squares = scale_a * scale_a * a.squares + scale_b * scale_b * b.squares;
  a.sum_exp = a.sum_exp * scale_a + b.sum_exp * scale_b;
  if (b.max > a.max && b.argmax >= 0) a.argmax = b.argmax + offset;  // ties keep the earlier column
  a.max = max;
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
namespace {
// The target built and run by this CPU that `name` names; 0 for none.
int64_t target_named(const std::string& name) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    if (name == hwy::TargetName(target)) return target;
  }
  return 0;
}
}  // namespace
std::string simd_target_error(const std::string& name) {
  if (name.empty() || target_named(name) != 0) return "";
  std::string available;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    available += (available.empty() ? "" : ", ") + std::string(hwy::TargetName(target));
  }
  return "expected one of " + available + " (the targets built that this CPU runs), got " + name;
}
std::string use_simd_target(const std::string& name) {
  if (std::string error = simd_target_error(name); !error.empty()) return error;
  hwy::SetSupportedTargetsForTest(name.empty() ? 0 : target_named(name));  // (0: every target, the best chosen)
  return "";
}
bool exp_argument_is_exact() { return HWY_DYNAMIC_DISPATCH(ExpArgumentIsExactImpl)(); }
float row_max(const void* row, StorageType type, int64_t cols, float* widened) {
  return HWY_DYNAMIC_DISPATCH(RowMaxImpl)(row, static_cast<int32_t>(type), cols, widened);
}
double exp_row_in_place(float* row, int64_t cols, float shift) {
  return HWY_DYNAMIC_DISPATCH(ExpRowInPlaceImpl)(row, cols, shift);
}

}  // namespace vpce::detail
#endif  // HWY_ONCE
