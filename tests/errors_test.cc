// tests/errors_test.cc: bad input to every public entry returns an error that names the
// argument and says what was expected and what came; nothing is written, the logits are
// untouched, nothing crashes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "common/text.h"
#include "support.h"

namespace vpce::test {
namespace {

constexpr int64_t kTokens = 6;
constexpr int64_t kVocab = 10;

// One rank's worth of valid arguments, with sentinel-filled outputs.
struct Fixture {
  std::vector<float> logits = std::vector<float>(kTokens * kVocab);
  std::vector<int64_t> targets = {0, 1, 2, 3, 8, 9};
  std::vector<float> loss = std::vector<float>(kTokens, -7.0f);
  std::vector<float> lse = std::vector<float>(kTokens, -7.0f);
  std::vector<float> grad_loss = std::vector<float>(kTokens, 1.0f);
  std::vector<float> grad = std::vector<float>(kTokens * kVocab, -7.0f);
  std::vector<float> logits_before;
  VocabShard shard{0, kVocab, kVocab};
  LossOptions options;

  Fixture() {
    for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
    logits_before = logits;
    options.num_threads = 1;
  }
  TensorView x() { return TensorView::contiguous(logits.data(), kFloat32, {kTokens, kVocab}); }
  TensorView y() { return TensorView::contiguous(targets.data(), kInt64, {kTokens}); }
  TensorView loss_view() { return TensorView::contiguous(loss.data(), kFloat32, {kTokens}); }
  TensorView lse_view() { return TensorView::contiguous(lse.data(), kFloat32, {kTokens}); }
  TensorView g() { return TensorView::contiguous(grad_loss.data(), kFloat32, {kTokens}); }
  TensorView grad_view() { return TensorView::contiguous(grad.data(), kFloat32, {kTokens, kVocab}); }

  Status run_forward(const TensorView& x_, const TensorView& y_, const TensorView& loss_, const TensorView& lse_) {
    std::unique_ptr<ThreadGroup> group;
    EXPECT_TRUE(ThreadGroup::create(1, &group).ok());
    return forward(group->communicator(0), x_, y_, shard, options, loss_, lse_);
  }
  Status run_forward() { return run_forward(x(), y(), loss_view(), lse_view()); }
  Status run_backward(const TensorView& grad_) { return backward(x(), y(), lse_view(), g(), shard, options, grad_); }
  Status run_backward() { return run_backward(grad_view()); }

  void expect_nothing_written() {
    EXPECT_EQ(logits, logits_before) << "the logits were modified";
    for (float v : loss) EXPECT_EQ(v, -7.0f) << "loss was written";
    for (float v : lse) EXPECT_EQ(v, -7.0f) << "lse was written";
    for (float v : grad) EXPECT_EQ(v, -7.0f) << "grad was written";
  }
};

void expect_error(const Status& s, Code code, std::initializer_list<const char*> fragments) {
  EXPECT_EQ(s.code(), code) << s.to_string();
  for (const char* f : fragments)
    EXPECT_NE(s.message().find(f), std::string::npos) << "missing '" << f << "' in: " << s.message();
}

TEST(BadInput, TargetAtOrAboveVocabulary) {
  Fixture f;
  f.targets[4] = kVocab;
  expect_error(f.run_forward(), Code::kInvalidArgument, {"targets", "expected values in [0, 10)", "got 10 at token 4"});
  // Alone, a rank gets its own message, not the group's "rank 0 of 1: invalid argument: ...".
  EXPECT_EQ(f.run_forward().message().rfind("targets: expected values in [0, 10)", 0), 0u);
  expect_error(f.run_backward(), Code::kInvalidArgument, {"targets", "got 10 at token 4"});
  f.expect_nothing_written();
}

TEST(BadInput, NegativeTarget) {
  Fixture f;
  f.targets[0] = -1;
  expect_error(f.run_forward(), Code::kInvalidArgument, {"targets", "got -1 at token 0"});
  f.expect_nothing_written();
}

TEST(BadInput, LogitsWidthDoesNotMatchShard) {
  Fixture f;
  f.shard = {0, 9, kVocab};
  expect_error(f.run_forward(), Code::kInvalidArgument, {"logits.shape[-1]", "expected 9", "got 10"});
  f.expect_nothing_written();
}

TEST(BadInput, ShardOutsideVocabulary) {
  Fixture f;
  f.shard = {2, 12, kVocab};
  expect_error(f.run_forward(), Code::kInvalidArgument, {"shard", "vocab_end <= vocab_size", "[2, 12) of 10"});
  f.shard = {5, 4, kVocab};
  expect_error(f.run_backward(), Code::kInvalidArgument, {"shard", "vocab_begin <= vocab_end"});
  f.shard = {0, kVocab, 0};
  expect_error(f.run_forward(), Code::kInvalidArgument, {"shard.vocab_size", "[1, 2^31 - 1]", "got 0"});
  f.expect_nothing_written();
}

TEST(BadInput, TargetsCountDoesNotMatchTokens) {
  Fixture f;
  expect_error(f.run_forward(f.x(), TensorView::contiguous(f.targets.data(), kInt64, {5}), f.loss_view(), f.lse_view()),
               Code::kInvalidArgument, {"targets.shape", "expected 6 elements", "got 5"});
  f.expect_nothing_written();
}

TEST(BadInput, LossShapeDoesNotFit) {
  Fixture f;
  expect_error(f.run_forward(f.x(), f.y(), TensorView::contiguous(f.loss.data(), kFloat32, {3, 3}), f.lse_view()),
               Code::kInvalidArgument, {"loss.shape", "expected 6 elements", "got 9"});
  f.expect_nothing_written();
}

TEST(BadInput, VocabularyDimensionNotContiguous) {
  Fixture f;
  expect_error(f.run_forward(TensorView::strided(f.logits.data(), kFloat32, {kTokens, 5}, {kVocab, 2}), f.y(),
                             f.loss_view(), f.lse_view()),
               Code::kInvalidArgument, {"logits.strides[1]", "expected 1", "got 2"});
  f.expect_nothing_written();
}

TEST(BadInput, OverlappingRows) {
  Fixture f;
  f.shard = {0, kVocab, kVocab};
  expect_error(f.run_forward(TensorView::matrix(f.logits.data(), kFloat32, kTokens, kVocab, 4), f.y(), f.loss_view(),
                             f.lse_view()),
               Code::kInvalidArgument, {"logits row stride", "expected >= 10", "got 4"});
  f.expect_nothing_written();
}

TEST(BadInput, LeadingDimensionsThatDoNotCollapse) {
  Fixture f;
  // [2, 3, 10] with a gap between the two halves that breaks the single row stride.
  std::vector<float> big(100);
  expect_error(f.run_forward(TensorView::strided(big.data(), kFloat32, {2, 3, kVocab}, {40, kVocab, 1}), f.y(),
                             f.loss_view(), f.lse_view()),
               Code::kInvalidArgument, {"logits.strides[0]", "expected 30", "got 40"});
  f.expect_nothing_written();
}

TEST(BadInput, NegativeStride) {
  Fixture f;
  expect_error(f.run_forward(f.x(), TensorView::strided(f.targets.data() + 5, kInt64, {kTokens}, {-1}), f.loss_view(),
                             f.lse_view()),
               Code::kInvalidArgument, {"targets.strides[0]", "positive stride", "got -1"});
  f.expect_nothing_written();
}

TEST(BadInput, UnsupportedLogitsDtype) {
  Fixture f;
  std::vector<double> wide(kTokens * kVocab);
  expect_error(f.run_forward(TensorView::contiguous(wide.data(), kFloat64, {kTokens, kVocab}), f.y(), f.loss_view(),
                             f.lse_view()),
               Code::kInvalidArgument, {"logits.dtype", "float32, bfloat16 or float16", "got float64"});
  const DataType vector_type{TypeCode::kFloat, 32, 4};
  expect_error(f.run_forward(TensorView::contiguous(f.logits.data(), vector_type, {kTokens, kVocab}), f.y(),
                             f.loss_view(), f.lse_view()),
               Code::kInvalidArgument, {"logits.dtype", "got float32x4"});
  // Other DLPack types by the names NumPy and PyTorch give them.
  std::vector<uint8_t> bytes(kTokens * kVocab);
  for (const auto& [type, name] : {std::pair{DataType{TypeCode::kUInt, 8, 1}, "got uint8"},
                                   std::pair{DataType{static_cast<TypeCode>(6), 8, 1}, "got bool"},
                                   std::pair{DataType{TypeCode::kInt, 16, 1}, "got int16"}}) {
    expect_error(f.run_forward(TensorView::contiguous(bytes.data(), type, {kTokens, kVocab}), f.y(), f.loss_view(),
                               f.lse_view()),
                 Code::kInvalidArgument, {"logits.dtype", name});
  }
  f.expect_nothing_written();
}

TEST(BadInput, UnsupportedTargetsAndOutputDtypes) {
  Fixture f;
  expect_error(
      f.run_forward(f.x(), TensorView::contiguous(f.logits.data(), kFloat32, {kTokens}), f.loss_view(), f.lse_view()),
      Code::kInvalidArgument, {"targets.dtype", "int32 or int64", "got float32"});
  std::vector<uint16_t> half(kTokens);
  expect_error(f.run_forward(f.x(), f.y(), TensorView::contiguous(half.data(), kFloat16, {kTokens}), f.lse_view()),
               Code::kInvalidArgument, {"loss.dtype", "float32", "got float16"});
  std::vector<double> wide(kTokens * kVocab);
  expect_error(f.run_backward(TensorView::contiguous(wide.data(), kFloat64, {kTokens, kVocab})), Code::kInvalidArgument,
               {"grad_logits.dtype", "got float64"});
  // The lse: float64 or float32, in the forward, the staged loss and the backward.
  const TensorView half_lse = TensorView::contiguous(half.data(), kFloat16, {kTokens});
  expect_error(f.run_forward(f.x(), f.y(), f.loss_view(), half_lse), Code::kInvalidArgument,
               {"lse.dtype: expected float64 or float32, got float16"});
  std::vector<float> stats(kTokens * kStatsWidth, 0.0f);
  expect_error(calculate_loss(TensorView::contiguous(stats.data(), kFloat32, {kTokens, kStatsWidth}), f.y(), kVocab,
                              f.options, f.loss_view(), half_lse),
               Code::kInvalidArgument, {"lse.dtype: expected float64 or float32, got float16"});
  expect_error(backward(f.x(), f.y(), half_lse, f.g(), f.shard, f.options, f.grad_view()), Code::kInvalidArgument,
               {"lse.dtype: expected float64 or float32, got float16"});
  f.expect_nothing_written();
}

TEST(BadInput, LabelSmoothingOutsideRange) {
  for (float a : {-0.1f, 1.0f, 2.0f, std::numeric_limits<float>::quiet_NaN()}) {
    Fixture f;
    f.options.label_smoothing = a;
    expect_error(f.run_forward(), Code::kInvalidArgument, {"options.label_smoothing", "[0, 1)"});
    expect_error(f.run_backward(), Code::kInvalidArgument, {"options.label_smoothing"});
    f.expect_nothing_written();
  }
}

TEST(BadInput, LabelSmoothingNeedsTwoClasses) {
  Fixture f;
  std::vector<float> one(kTokens);
  std::vector<int64_t> zeros(kTokens, 0);
  f.shard = {0, 1, 1};
  f.options.label_smoothing = 0.1f;
  expect_error(f.run_forward(TensorView::contiguous(one.data(), kFloat32, {kTokens, 1}),
                             TensorView::contiguous(zeros.data(), kInt64, {kTokens}), f.loss_view(), f.lse_view()),
               Code::kInvalidArgument, {"valid vocabulary size", ">= 2 when Megatron label smoothing", "got 1"});
  f.expect_nothing_written();
}

TEST(BadInput, NullPointers) {
  Fixture f;
  expect_error(
      f.run_forward(TensorView::contiguous(nullptr, kFloat32, {kTokens, kVocab}), f.y(), f.loss_view(), f.lse_view()),
      Code::kInvalidArgument, {"logits.data", "non-null", "got null"});
  expect_error(f.run_forward(f.x(), TensorView::contiguous(nullptr, kInt64, {kTokens}), f.loss_view(), f.lse_view()),
               Code::kInvalidArgument, {"targets.data", "got null"});
  expect_error(f.run_forward(f.x(), f.y(), TensorView::contiguous(nullptr, kFloat32, {kTokens}), f.lse_view()),
               Code::kInvalidArgument, {"loss.data", "got null"});
  expect_error(f.run_forward(f.x(), f.y(), f.loss_view(), TensorView::contiguous(nullptr, kFloat32, {kTokens})),
               Code::kInvalidArgument, {"lse.data", "got null"});
  expect_error(f.run_backward(TensorView::contiguous(nullptr, kFloat32, {kTokens, kVocab})), Code::kInvalidArgument,
               {"grad_logits.data", "got null"});
  expect_error(ThreadGroup::create(2, nullptr), Code::kInvalidArgument, {"group", "got null"});
  f.expect_nothing_written();
}

TEST(BadInput, MisalignedPointer) {
  Fixture f;
  TensorView x = f.x();
  x.byte_offset = 2;
  expect_error(f.run_forward(x, f.y(), f.loss_view(), f.lse_view()), Code::kInvalidArgument,
               {"logits", "aligned to 4 bytes", "got address"});
  f.expect_nothing_written();
}

// A byte_offset that carries data + byte_offset past the address space (2^63 into the
// kernel's half; 2^64 - 32, which wrapped to 32 bytes before the buffer and read them with
// success), or whose view's end does: refused, naming it, on the logits, the targets and an
// output, before anything is read or written (it crashed in the kernels).
TEST(BadInput, AByteOffsetBeyondTheAddressSpace) {
  Fixture f;
  std::vector<uint64_t> offsets = {~uint64_t{0} - 31, ~uint64_t{0} - 4095};  // wrapping: on every CPU
#if defined(__x86_64__)
  offsets.push_back(uint64_t{1} << 63);  // the kernel's half (AArch64's tagged pointers may set bit 63)
#endif
  for (const uint64_t offset : offsets) {
    TensorView x = f.x();
    x.byte_offset = offset;
    expect_error(f.run_forward(x, f.y(), f.loss_view(), f.lse_view()), Code::kInvalidArgument,
                 {"logits.byte_offset: expected data + byte_offset + the view's 240 bytes inside the address space",
                  ("got " + std::to_string(offset) + " (data 0x").c_str()});
    TensorView y = f.y();
    y.byte_offset = offset;
    expect_error(f.run_forward(f.x(), y, f.loss_view(), f.lse_view()), Code::kInvalidArgument,
                 {"targets.byte_offset: expected"});
    TensorView grad = f.grad_view();
    grad.byte_offset = offset;
    expect_error(f.run_backward(grad), Code::kInvalidArgument, {"grad_logits.byte_offset: expected"});
  }
  f.expect_nothing_written();
}

TEST(BadInput, DeviceThisBuildCannotServe) {
  Fixture f;
  const TensorView x =
      TensorView::contiguous(f.logits.data(), kFloat32, {kTokens, kVocab}, Device{DeviceType::kCUDA, 0});
  expect_error(f.run_forward(x, f.y(), f.loss_view(), f.lse_view()), Code::kUnsupported,
               {"logits.device", "expected cpu", "got cuda:0"});
  f.expect_nothing_written();
}

TEST(BadInput, TooManyOrTooFewDimensions) {
  Fixture f;
  const TensorView nine = TensorView::contiguous(f.logits.data(), kFloat32, {1, 1, 1, 1, 1, 1, 1, kTokens, kVocab});
  expect_error(f.run_forward(nine, f.y(), f.loss_view(), f.lse_view()), Code::kInvalidArgument,
               {"logits.ndim", "1 to 8"});
  const TensorView scalar = TensorView::contiguous(f.logits.data(), kFloat32, {});
  expect_error(f.run_forward(scalar, f.y(), f.loss_view(), f.lse_view()), Code::kInvalidArgument,
               {"logits.ndim", "got 0"});
  f.expect_nothing_written();
}

TEST(BadInput, GradientOverlapsLogitsWithoutBeingInPlace) {
  Fixture f;
  const TensorView shifted = TensorView::contiguous(f.logits.data() + 1, kFloat32, {kTokens - 1, kVocab});
  f.targets.pop_back();
  expect_error(
      backward(TensorView::contiguous(f.logits.data(), kFloat32, {kTokens - 1, kVocab}),
               TensorView::contiguous(f.targets.data(), kInt64, {kTokens - 1}),
               TensorView::contiguous(f.lse.data(), kFloat32, {kTokens - 1}),
               TensorView::contiguous(f.grad_loss.data(), kFloat32, {kTokens - 1}), f.shard, f.options, shifted),
      Code::kInvalidArgument, {"grad_logits", "does not overlap"});
  EXPECT_EQ(f.logits, f.logits_before);
}

TEST(BadInput, InPlaceGradientWithAnotherDtype) {
  Fixture f;
  const TensorView as_half = TensorView::contiguous(f.logits.data(), kBFloat16, {kTokens, kVocab});
  expect_error(f.run_backward(as_half), Code::kInvalidArgument, {"grad_logits", "in-place", "float32", "bfloat16"});
  f.expect_nothing_written();
}

TEST(BadInput, OutputsOverlapEachOther) {
  Fixture f;
  expect_error(f.run_forward(f.x(), f.y(), f.loss_view(), f.loss_view()), Code::kInvalidArgument,
               {"loss", "does not overlap lse"});
  f.expect_nothing_written();
}

TEST(BadInput, NegativeThreadCount) {
  Fixture f;
  f.options.num_threads = -2;
  expect_error(f.run_forward(), Code::kInvalidArgument, {"options.num_threads", "got -2"});
  f.expect_nothing_written();
}

// More threads than OpenMP can make crashes it (or it calls exit): refused, by name.
TEST(BadInput, ThreadCountBeyondFourPerHardwareThread) {
  Fixture f;
  f.options.num_threads = 100000;
  expect_error(f.run_forward(), Code::kInvalidArgument,
               {"options.num_threads", "at most 4 x this machine's", "got 100000"});
  f.expect_nothing_written();
}

// With label smoothing the merge rebases each rank's sum of logits by its column count, so
// merge_stats over R > 1 ranks needs their shards: missing, one too few, a gap, an overlap,
// a range beyond V or shards of different V are each an error that names them, and nothing
// is written.
TEST(BadInput, SmoothedMergeNeedsTheRanksShards) {
  std::vector<float> gathered(2 * kTokens * 4, 1.0f), merged(kTokens * 4, -7.0f);
  const TensorView all = TensorView::contiguous(gathered.data(), kFloat32, {2, kTokens, 4});
  const TensorView out = TensorView::contiguous(merged.data(), kFloat32, {kTokens, 4});
  LossOptions options;
  options.label_smoothing = 0.1f;
  expect_error(merge_stats(all, options, out), Code::kInvalidArgument,
               {"shards", "the 2 ranks' VocabShards", "got none"});
  const VocabShard one[] = {{0, 10, 10}};
  expect_error(merge_stats(all, options, out, one), Code::kInvalidArgument,
               {"shards", "one VocabShard per rank (gathered.shape[0] = 2)", "got 1 shards"});
  const VocabShard gap[] = {{0, 4, 10}, {5, 10, 10}};
  expect_error(merge_stats(all, options, out, gap), Code::kInvalidArgument,
               {"shards", "partition [0, 10)", "a gap at column 4"});
  const VocabShard overlap[] = {{0, 6, 10}, {5, 10, 10}};
  expect_error(merge_stats(all, options, out, overlap), Code::kInvalidArgument,
               {"shards", "partition [0, 10)", "an overlap at column 5"});
  const VocabShard short_end[] = {{0, 5, 10}, {5, 9, 10}};
  expect_error(merge_stats(all, options, out, short_end), Code::kInvalidArgument,
               {"shards", "partition [0, 10)", "a gap at column 9"});
  const VocabShard beyond[] = {{0, 5, 10}, {5, 11, 10}};
  expect_error(merge_stats(all, options, out, beyond), Code::kInvalidArgument,
               {"shards[1].vocab_begin, .vocab_end", "<= vocab_size (10)", "got 5, 11"});
  const VocabShard sizes[] = {{0, 5, 10}, {5, 10, 12}};
  expect_error(merge_stats(all, options, out, sizes), Code::kInvalidArgument,
               {"shards[1].vocab_size", "shards[0]'s 10", "got 12"});
  for (float m : merged) EXPECT_EQ(m, -7.0f);
  // Without smoothing the shards may be left out; with them the merge works.
  options.label_smoothing = 0.0f;
  EXPECT_TRUE(merge_stats(all, options, out).ok());
  options.label_smoothing = 0.1f;
  const VocabShard good[] = {{5, 10, 10}, {0, 5, 10}};  // any order of ranges
  EXPECT_TRUE(merge_stats(all, options, out, good).ok());
  // An empty range owns nothing, wherever it starts (as the one-call forward's check has it).
  std::vector<float> three(3 * kTokens * 4, 1.0f);
  const VocabShard with_empty[] = {{0, 5, 10}, {5, 10, 10}, {7, 7, 10}};
  EXPECT_TRUE(
      merge_stats(TensorView::contiguous(three.data(), kFloat32, {3, kTokens, 4}), options, out, with_empty).ok());
}

TEST(BadInput, StagedApiChecksItsArguments) {
  Fixture f;
  std::vector<float> stats(kTokens * 4, -7.0f);
  expect_error(calculate_local_stats(f.x(), f.y(), f.shard, f.options,
                                     TensorView::contiguous(stats.data(), kFloat32, {kTokens, 3})),
               Code::kInvalidArgument, {"stats.shape", "[6, 4]", "got [6, 3]"});
  expect_error(merge_stats(TensorView::contiguous(stats.data(), kFloat32, {kTokens, 4}), f.options,
                           TensorView::contiguous(stats.data(), kFloat32, {kTokens, 4})),
               Code::kInvalidArgument, {"gathered.ndim", "expected 3", "got 2"});
  std::vector<float> merged(kTokens * 4);
  expect_error(merge_stats(TensorView::contiguous(stats.data(), kFloat32, {1, kTokens, 4}), f.options,
                           TensorView::contiguous(stats.data(), kFloat32, {kTokens, 4})),
               Code::kInvalidArgument, {"stats", "does not overlap gathered"});
  expect_error(calculate_loss(TensorView::contiguous(stats.data(), kFloat32, {kTokens, 4}), f.y(), 0, f.options,
                              f.loss_view(), f.lse_view()),
               Code::kInvalidArgument, {"vocab_size", "[1, 2^31 - 1]", "got 0"});
  // merge_stats checks its options as the other stages do (it took any: a smoothing of 2, a
  // negative scale, and a thread count that crashed in OpenMP), with shards and without.
  const TensorView gathered = TensorView::contiguous(stats.data(), kFloat32, {1, kTokens, 4});
  const TensorView merged_view = TensorView::contiguous(merged.data(), kFloat32, {kTokens, 4});
  const VocabShard whole[] = {f.shard};
  const std::pair<LossOptions, const char*> bad[] = {
      {[] {
         LossOptions o;
         o.num_threads = 100000;
         return o;
       }(),
       "options.num_threads: expected in [0, "},
      {[] {
         LossOptions o;
         o.label_smoothing = 2.0f;
         return o;
       }(),
       "options.label_smoothing: expected a value in [0, 1), got 2"},
      {[] {
         LossOptions o;
         o.logit_scale = -3.0f;
         return o;
       }(),
       "options.logit_scale: expected a finite value > 0, got -3"},
      {[] {
         LossOptions o;
         o.reduction = static_cast<Reduction>(7);
         return o;
       }(),
       "options.reduction: expected kNone (0), kSum (1) or kMean (2), got 7"},
  };
  for (const auto& [options, want] : bad) {
    expect_error(merge_stats(gathered, options, merged_view, whole), Code::kInvalidArgument, {want});
    expect_error(merge_stats(gathered, options, merged_view), Code::kInvalidArgument, {want});
  }
  LossOptions too_big_valid;
  too_big_valid.valid_vocab_size = kVocab + 1;
  expect_error(merge_stats(gathered, too_big_valid, merged_view, whole), Code::kInvalidArgument,
               {"options.valid_vocab_size: expected a value in [0, 10]"});
  // The staged API refuses Megatron's legacy smoothing at its first stage too (it took it).
  LossOptions legacy = f.options;
  legacy.smoothing_semantics = SmoothingSemantics::kMegatronLegacy;
  expect_error(calculate_local_stats(f.x(), f.y(), f.shard, legacy,
                                     TensorView::contiguous(stats.data(), kFloat32, {kTokens, 4})),
               Code::kInvalidArgument, {"options.smoothing_semantics", "calculate_local_stats"});
  for (float s : stats) EXPECT_EQ(s, -7.0f);
  for (float m : merged) EXPECT_EQ(m, 0.0f);
  f.expect_nothing_written();
}

TEST(BadInput, ThreadGroupSize) {
  std::unique_ptr<ThreadGroup> group;
  expect_error(ThreadGroup::create(0, &group), Code::kInvalidArgument, {"num_ranks", "[1, 4096]", "got 0"});
  expect_error(ThreadGroup::create(2, &group, std::chrono::milliseconds(0)), Code::kInvalidArgument, {"timeout"});
  ASSERT_TRUE(ThreadGroup::create(2, &group).ok());
  Fixture f;
  expect_error(forward(group->communicator(5), f.x(), f.y(), f.shard, f.options, f.loss_view(), f.lse_view()),
               Code::kInvalidArgument, {"comm", "rank -1 of 0"});
  f.expect_nothing_written();
}

TEST(BadInput, ZLossWeightNegativeOrNotFinite) {
  for (float w : {-0.1f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    Fixture f;
    f.options.z_loss_weight = w;
    expect_error(f.run_forward(), Code::kInvalidArgument, {"options.z_loss_weight", "finite value >= 0"});
    f.expect_nothing_written();
  }
}

TEST(BadInput, LogitScaleNotPositive) {
  for (float c : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    Fixture f;
    f.options.logit_scale = c;
    expect_error(f.run_backward(), Code::kInvalidArgument, {"options.logit_scale", "finite value > 0"});
    f.expect_nothing_written();
  }
}

// A subnormal cap is refused too: 1 / softcap would overflow to inf and make the loss NaN.
TEST(BadInput, SoftcapNegativeInfiniteOrSubnormal) {
  for (float c : {-2.0f, std::numeric_limits<float>::infinity(), 1e-40f, std::numeric_limits<float>::denorm_min()}) {
    Fixture f;
    f.options.softcap = c;
    const std::string got = "got " + detail::number_text(c);
    expect_error(f.run_forward(), Code::kInvalidArgument,
                 {"options.softcap", "0 (off) or a finite value >= 1.1754944e-38", got.c_str()});
    f.expect_nothing_written();
  }
}

// Values print with the digits that tell them apart: -1e-10, not -0.000000.
TEST(BadInput, OptionValuesPrintEveryDigitTheyNeed) {
  Fixture f;
  f.options.label_smoothing = -1e-10f;
  expect_error(f.run_forward(), Code::kInvalidArgument, {"options.label_smoothing", "got -1e-10"});
  f.options.label_smoothing = 0.0f;
  f.options.z_loss_weight = -1e-30f;
  expect_error(f.run_forward(), Code::kInvalidArgument, {"options.z_loss_weight", "got -1e-30"});
  f.expect_nothing_written();
}

TEST(BadInput, ValidVocabularyLargerThanVocabulary) {
  Fixture f;
  f.options.valid_vocab_size = kVocab + 1;
  expect_error(f.run_forward(), Code::kInvalidArgument, {"options.valid_vocab_size", "[0, 10]", "got 11"});
  f.expect_nothing_written();
}

TEST(BadInput, TargetInThePaddedColumns) {
  Fixture f;
  f.options.valid_vocab_size = 9;
  expect_error(f.run_forward(), Code::kInvalidArgument, {"targets", "[0, 9)", "got 9 at token 5"});
  f.expect_nothing_written();
}

TEST(BadInput, UnknownReductionOrSemantics) {
  Fixture f;
  f.options.reduction = static_cast<Reduction>(5);
  expect_error(f.run_forward(), Code::kInvalidArgument, {"options.reduction", "got 5"});
  f.options.reduction = Reduction::kNone;
  f.options.smoothing_semantics = static_cast<SmoothingSemantics>(-1);
  expect_error(f.run_backward(), Code::kInvalidArgument, {"options.smoothing_semantics", "got -1"});
  f.expect_nothing_written();
}

TEST(BadInput, WeightsNotFinite) {
  Fixture f;
  std::vector<float> w(kTokens, 1.0f);
  w[3] = std::numeric_limits<float>::quiet_NaN();
  const TensorView weights = TensorView::contiguous(w.data(), kFloat32, {kTokens});
  ForwardExtras extras;
  extras.weights = &weights;
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  expect_error(forward(group->communicator(0), f.x(), f.y(), f.shard, f.options, f.loss_view(), f.lse_view(), extras),
               Code::kInvalidArgument, {"weights", "finite values >= 0", "got nan at token 3"});
  expect_error(backward(f.x(), f.y(), f.lse_view(), f.g(), f.shard, f.options, f.grad_view(), &weights),
               Code::kInvalidArgument, {"weights", "at token 3"});
  f.expect_nothing_written();
}

// Negative weights are refused, so that a mean's denominator (the counted tokens' weights)
// is 0 only when every counted weight is 0, the empty batch, whose loss and gradient are 0.
TEST(BadInput, WeightsNegative) {
  Fixture f;
  std::vector<float> w(kTokens, 1.0f);
  w[2] = -1.0f;  // with w[3] = 1 the two would cancel in a mean's denominator
  const TensorView weights = TensorView::contiguous(w.data(), kFloat32, {kTokens});
  ForwardExtras extras;
  extras.weights = &weights;
  std::unique_ptr<ThreadGroup> group;
  ASSERT_TRUE(ThreadGroup::create(1, &group).ok());
  f.options.reduction = Reduction::kMean;
  expect_error(forward(group->communicator(0), f.x(), f.y(), f.shard, f.options, f.loss_view(), f.lse_view(), extras),
               Code::kInvalidArgument, {"weights", "finite values >= 0", "got -1 at token 2"});
  expect_error(backward(f.x(), f.y(), f.lse_view(), f.g(), f.shard, f.options, f.grad_view(), &weights),
               Code::kInvalidArgument, {"weights", "got -1 at token 2"});
  f.expect_nothing_written();
}

TEST(BadInput, WeightsWrongDtypeOrCount) {
  Fixture f;
  std::vector<double> wide(kTokens, 1.0);
  const TensorView as_double = TensorView::contiguous(wide.data(), kFloat64, {kTokens});
  expect_error(backward(f.x(), f.y(), f.lse_view(), f.g(), f.shard, f.options, f.grad_view(), &as_double),
               Code::kInvalidArgument, {"weights.dtype", "float32", "got float64"});
  std::vector<float> few(kTokens - 1, 1.0f);
  const TensorView short_weights = TensorView::contiguous(few.data(), kFloat32, {kTokens - 1});
  expect_error(backward(f.x(), f.y(), f.lse_view(), f.g(), f.shard, f.options, f.grad_view(), &short_weights),
               Code::kInvalidArgument, {"weights.shape", "expected 6 elements", "got 5"});
  f.expect_nothing_written();
}

TEST(BadInput, ReducedLossNeedsOneElement) {
  Fixture f;
  f.options.reduction = Reduction::kMean;
  expect_error(f.run_forward(), Code::kInvalidArgument, {"loss.shape", "expected 1 element (a reduced loss)", "got 6"});
  expect_error(f.run_backward(), Code::kInvalidArgument, {"grad_loss.shape", "expected 1 element", "got 6"});
  f.expect_nothing_written();
}

TEST(BadInput, ExtrasNeedTheWideStats) {
  Fixture f;
  std::vector<float> stats(kTokens * 4, 0.5f), entropy(kTokens, -7.0f);
  const TensorView entropy_view = TensorView::contiguous(entropy.data(), kFloat32, {kTokens});
  ForwardExtras extras;
  extras.entropy = &entropy_view;
  expect_error(calculate_loss(TensorView::contiguous(stats.data(), kFloat32, {kTokens, 4}), f.y(), kVocab, f.options,
                              f.loss_view(), f.lse_view(), extras),
               Code::kInvalidArgument, {"stats", "6 columns", "entropy", "got 4"});
  for (float e : entropy) EXPECT_EQ(e, -7.0f);
  f.expect_nothing_written();
}

TEST(BadInput, VocabularyTooLargeForInt32Indices) {
  Fixture f;
  f.shard = {0, kVocab, int64_t{1} << 31};
  expect_error(f.run_forward(), Code::kInvalidArgument, {"shard.vocab_size", "[1, 2^31 - 1]", "got 2147483648"});
  f.expect_nothing_written();
}

}  // namespace
}  // namespace vpce::test
