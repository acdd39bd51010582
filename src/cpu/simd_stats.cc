// cpu/simd_stats.cc: a block's statistics (simd_rows.h's block_stats), written once with
// Google Highway and compiled for every x86 target it attains (AVX-512, AVX2, SSE4, SSSE3)
// plus scalar; the best one the CPU supports is chosen at run time.
//
// Statistics of a block are taken a chunk of 256 vectors at a time while it is in L1: the
// chunk's max, then the sums of exp(z - m) (and of z when asked) with m the running max,
// in fp32 lanes within a chunk and fp64 across chunks; with the extras (argmax, the
// weighted sum) the whole block takes two passes from a stack buffer. The block is read once
// and nothing is stored.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd_stats.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/simd/exp-inl.h"
#include "cpu/simd/transform-inl.h"
#include "cpu/simd/vectors-inl.h"

HWY_BEFORE_NAMESPACE();
namespace vpce::detail {
namespace HWY_NAMESPACE {

// ---- block statistics ---------------------------------------------------------------------

// The lanes' sums of logits relative to the max are kept times 2^-32: a chunk's 4096 offsets
// then fit fp32's range whatever the logits (offsets up to 6.8e38).
constexpr float kLogitSumScale = 0x1p-32f;

// The forward's lanes of exponentials fold into their fp64 sum every this many vectors.
constexpr int64_t kFoldVectors = 32;

// row: [cols] of T -> BlockStats, a chunk of 256 vectors (in L1) at a time: the chunk's max,
// then the sum of e^(z - m) with m the max so far (as e^z 2^E 2^phi, see ExpShifted), the
// earlier chunks' fp64 sum rescaled when m grows (rarely, after the first chunks). Each
// exponent is exact before its one rounding, and the block is read from memory once, with
// no store. (The argmax and the weighted sum take the two-pass
// route below.)
// kWithSumLogits: the logits' sum too (label smoothing), fixed at compile time so that the
// loop of the sums tests nothing per vector.
template <class T, int kKind, bool kWithSumLogits>
void StatsByChunks(const T* row, int64_t cols, const TransformParams& t, BlockStats* out) {
  // bf16 and fp16 logits, untransformed: the max pass on their 16-bit patterns (RawMax16).
  constexpr bool kRawMax = kKind == kIdentity && !std::is_same_v<T, float> && HWY_TARGET != HWY_SCALAR;
  // The raw max finds the lowest logit too, so that the sums leave the exp's clamp out where
  // it would change nothing: on the FMA targets but AVX-512 (AVX2's forward over bf16 and
  // fp16 7-10 % faster in cache, measured as AVX2 on an Emerald Rapids; AVX-512's no faster
  // there, so it keeps the one integer max: docs/performance.md, entry 55).
  constexpr bool kRawLowest = kRawMax && kExactArgument && HWY_TARGET != HWY_AVX3;
  // bf16 and fp16 logits, unless soft-capped: NaNs with their low bits 0 (ExponentialBelowShift).
  constexpr bool kHalfPrecisionLogits = !std::is_same_v<T, float> && kKind != kSoftCapped;
  const DF d;
  const ExpPolynomial<> poly(d);
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  // 256 vectors: the per-chunk work (the max's and the sums' reductions across lanes) comes
  // to 0.17 vector operations per 16 logits (0.6 with 64); eight accumulators, folded every
  // 32 vectors (below), keep each lane's fp32 sum of exponentials at 4 terms (and four keep
  // the logits' sums at 32 pairs, as one did).
  const int64_t chunk = 256 * lanes;
  // The sums' prefetches, 8 KiB ahead: the next chunk of bf16 or fp16 as they pass this one
  // (forward 22-27 % faster than 4 KiB, measured; fp32 stays at 8 KiB, 5 % slower at 16).
  constexpr auto ahead = static_cast<int64_t>(8192 / sizeof(T));
  float max = -std::numeric_limits<float>::infinity();
  LaneShift shift = MakeLaneShift(d, 0.0);  // of max, once there is one
  double sum_exp2 = 0.0;                    // sum e^(z - max) / shift.correction
  double sum_logits = 0.0;                  // sum (z - logit_reference(max))
  for (int64_t begin = 0; begin < cols; begin += chunk) {
    const int64_t end = std::min(cols, begin + chunk);
    const int64_t full_end = end - (end - begin) % lanes;
    const auto tail = static_cast<size_t>(end - full_end);
    const bool has_tail = tail != 0;
    // Lanes past the end hold -inf: they add nothing.
    const VF z_tail = has_tail ? hn::IfThenElse(hn::FirstN(d, tail),
                                                Transform<kKind>(d, LoadPartial(d, row + full_end, tail), t), neg_inf)
                               : neg_inf;
    // Four independent maxima: one would wait on Max's latency at every vector.
    VF max0 = z_tail, max1 = neg_inf, max2 = neg_inf, max3 = neg_inf;
    int64_t v = begin;
    float raw_max = -std::numeric_limits<float>::infinity();
    float raw_lowest = -std::numeric_limits<float>::infinity();  // below every logit the raw max read
#if HWY_TARGET != HWY_SCALAR
    if constexpr (kRawMax) {
      v = begin +
          RawMax16<T, kRawLowest>(row + begin, (full_end - begin) / (4 * lanes), &raw_max, &raw_lowest) * 4 * lanes;
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
    // Whether the raw max read every whole vector of the chunk (its lowest then bounds them all).
    const bool raw_read_all = v == full_end;
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
      if constexpr (kWithSumLogits) sum_logits = rebased_logit_sum(sum_logits, begin, max, chunk_max);
      max = chunk_max;
      shift = grown;
    }
    // Every whole vector's logits at or above the exp's clamp, e^-87 (a NaN or -inf among them
    // fails this): the sums' loops leave the clamp out. Almost every chunk of real logits,
    // whose lowest lies less than 87 below the row's max.
    bool unclamped = false;
    if constexpr (kRawLowest) {
      unclamped = raw_read_all && !shift.subtract_first && raw_lowest >= hn::GetLane(shift.lanes.range.normal_low);
    }
    VF sums[8] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d),
                  hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
    // The chunk's fp64 sum of the accumulators' folds, in lanes: the fold takes an extraction
    // of the upper half, two widenings and two additions where a sum across the lanes took
    // about ten operations (the chunk's own sum across them is taken once, at its end).
#if HWY_TARGET == HWY_SCALAR
    double folded = 0.0;
    auto add_folded = [&](VF all) { folded += static_cast<double>(hn::GetLane(all)); };
    auto folded_sum = [&] { return folded; };
#else
    const hn::Repartition<double, DF> dd;
    const hn::Half<DF> dh;
    auto folded_low = hn::Zero(dd), folded_high = hn::Zero(dd);
    auto add_folded = [&](VF all) {
      folded_low = hn::Add(folded_low, hn::PromoteTo(dd, hn::LowerHalf(dh, all)));
      folded_high = hn::Add(folded_high, hn::PromoteTo(dd, hn::UpperHalf(dh, all)));
    };
    auto folded_sum = [&] { return hn::GetLane(hn::SumOfLanes(dd, hn::Add(folded_low, folded_high))); };
#endif
    // The accumulators' sum into the chunk's fp64 lanes, and they start again from 0.
    auto fold_sums = [&] {
      add_folded(hn::Add(hn::Add(hn::Add(sums[0], sums[1]), hn::Add(sums[2], sums[3])),
                         hn::Add(hn::Add(sums[4], sums[5]), hn::Add(sums[6], sums[7]))));
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
    auto sum_chunk = [&](auto subtract_first, auto whole_vectors_unclamped) {
      constexpr bool kSubtractFirst = decltype(subtract_first)::value;
      constexpr bool kUnclamped = decltype(whole_vectors_unclamped)::value;
      const ShiftLanes lanes_shift = shift.lanes;
      // A term of the sum: e^(z - max) / shift.correction (clamped: the tail's and the last vector's).
      auto term = [&](VF z) __attribute__((always_inline)) {
        return ExpShiftedAs<kSubtractFirst, true, false, kHalfPrecisionLogits>(d, z, lanes_shift, poly);
      };
      auto whole_term = [&](VF z) __attribute__((always_inline)) {
        return ExpShiftedAs<kSubtractFirst, true, false, kHalfPrecisionLogits, kUnclamped>(d, z, lanes_shift, poly);
      };
      // Two vectors into the accumulators `into` and `into + 1` (and `into / 2` of the logits).
      auto two = [&](int64_t at, int into) {
        hwy::Prefetch(row + at + ahead);  // spread over the exponentials, which leave time
        VF x0, x1;
        LoadTwo(d, row + at, x0, x1);
        const VF z0 = Transform<kKind>(d, x0, t), z1 = Transform<kKind>(d, x1, t);
        sums[into] = hn::Add(sums[into], whole_term(z0));
        sums[into + 1] = hn::Add(sums[into + 1], whole_term(z1));
        if constexpr (kWithSumLogits) {
          sums_z[into / 2] =
              hn::Add(sums_z[into / 2], hn::Add(hn::MulSub(z0, scale, reference), hn::MulSub(z1, scale, reference)));
        }
      };
      // The exponentials' lanes fold into the chunk's fp64 lanes every kFoldVectors vectors (4
      // terms a lane): summed over a whole chunk (32 a lane), their fp32 roundings had cost the
      // lse up to 3.5 x 2^-24, which the backward's p carries (docs/design.md).
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
        sum_e = hn::Add(sum_e, term(z));
        if constexpr (kWithSumLogits) sum_z = hn::Add(sum_z, hn::MulSub(z, scale, reference));
      }
      if (has_tail) {
        sum_e = hn::Add(sum_e, term(z_tail));
        if constexpr (kWithSumLogits) {
          sum_z = hn::Add(sum_z, hn::IfThenElseZero(hn::FirstN(d, tail), hn::MulSub(z_tail, scale, reference)));
        }
      }
    };
    if (shift.subtract_first) {
      sum_chunk(std::true_type{}, std::false_type{});
    } else if (unclamped) {
      if constexpr (kRawLowest) sum_chunk(std::false_type{}, std::true_type{});
    } else {
      sum_chunk(std::false_type{}, std::false_type{});
    }
    fold_sums();
    sum_exp2 += folded_sum();
    if constexpr (kWithSumLogits) {
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
void Stats(const T* row, int64_t cols, const TransformParams& t, bool with_sum_logits, bool with_weighted,
           BlockStats* out) {
  if (!with_weighted) {
    return with_sum_logits ? StatsByChunks<T, kKind, true>(row, cols, t, out)
                           : StatsByChunks<T, kKind, false>(row, cols, t, out);
  }
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
    s.squares = any_nan ? nan : 0.0;
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
    VF sum_exp = hn::Zero(d), sum_z = hn::Zero(d), weighted = hn::Zero(d), squares = hn::Zero(d);
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
        squares = hn::MulAdd(e, e, squares);
      }
    }
    s.sum_exp += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, sum_exp)));
    if (with_sum_logits) {
      s.sum_logits += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, sum_z))) / static_cast<double>(kLogitSumScale);
    }
    if (with_weighted) {
      s.weighted += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, weighted)));
      s.squares += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, squares)));
    }
  }
  s.sum_exp *= shift.correction;
  s.weighted *= shift.correction;
  s.squares *= shift.correction * shift.correction;
  *out = s;
}

template <class T>
void StatsForType(const void* row, int64_t cols, const TransformParams& t, bool with_sum_logits, bool with_weighted,
                  BlockStats* out) {
  const T* r = static_cast<const T*>(row);
  if (t.cap > 0.0f) {
    Stats<T, kSoftCapped>(r, cols, t, with_sum_logits, with_weighted, out);
  } else if (t.scale != 1.0f) {
    Stats<T, kScaled>(r, cols, t, with_sum_logits, with_weighted, out);
  } else {
    Stats<T, kIdentity>(r, cols, t, with_sum_logits, with_weighted, out);
  }
}

void BlockStatsImpl(const void* row, int32_t type, int64_t cols, const TransformParams& t, bool with_sum_logits,
                    bool with_weighted, BlockStats* out) {
  WithStorageType(type, [&](auto* tag) {
    StatsForType<TagType<decltype(tag)>>(row, cols, t, with_sum_logits, with_weighted, out);
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace vpce::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace vpce::detail {

HWY_EXPORT(BlockStatsImpl);

BlockStats block_stats(const void* row, StorageType type, int64_t cols, const TransformParams& t, bool with_sum_logits,
                       bool with_weighted) {
  BlockStats out;
  HWY_DYNAMIC_DISPATCH(BlockStatsImpl)(row, static_cast<int32_t>(type), cols, t, with_sum_logits, with_weighted, &out);
  out.columns = cols;
  return out;
}

}  // namespace vpce::detail
#endif  // HWY_ONCE
