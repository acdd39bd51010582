// fuzz/api_fuzzer.cc: random shapes, strides, offsets, dtypes, devices, ranges and options
// given to every public entry point (forward on a one-rank group, backward, and the four
// staged functions). Each call either succeeds or returns an error whose message says
// what was expected; on error no output changes; the forward never changes the logits.
// Each view gets a buffer exactly as large as its shape and strides claim, so any read or
// write outside it is a vpce bug that AddressSanitizer reports.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "vpce/vpce.h"

namespace {

using vpce::DataType;
using vpce::TensorView;

constexpr int64_t kMaxBytes = int64_t{1} << 20;

// The buffers behind the views of one input, kept until the input is done.
struct Arena {
  std::vector<std::unique_ptr<std::byte[]>> buffers;
  std::vector<std::pair<std::byte*, int64_t>> outputs;  // (start, bytes) to snapshot

  std::byte* allocate(int64_t bytes, FuzzedDataProvider& in) {
    buffers.push_back(std::make_unique<std::byte[]>(static_cast<size_t>(bytes) + 1));
    std::byte* p = buffers.back().get();
    for (int64_t i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>(in.ConsumeIntegral<uint8_t>() & 0x3f);
    return p;
  }
};

DataType fuzz_dtype(FuzzedDataProvider& in, DataType usual) {
  static const DataType kOthers[] = {vpce::kFloat32,
                                     vpce::kBFloat16,
                                     vpce::kFloat16,
                                     vpce::kFloat64,
                                     vpce::kInt32,
                                     vpce::kInt64,
                                     DataType{vpce::TypeCode::kUInt, 8, 1},
                                     DataType{vpce::TypeCode::kFloat, 32, 2}};
  return in.ConsumeIntegralInRange(0, 7) == 0 ? kOthers[in.ConsumeIntegralInRange(0, 7)] : usual;
}

// A view near `shape` (mostly exactly it), with buffer sized to what it claims.
TensorView fuzz_view(FuzzedDataProvider& in, Arena& arena, DataType usual, std::vector<int64_t> shape, bool output,
                     int64_t* buffer_bytes = nullptr) {
  TensorView t;
  t.dtype = fuzz_dtype(in, usual);
  if (in.ConsumeIntegralInRange(0, 5) == 0) {  // perturb the shape
    shape.resize(static_cast<size_t>(in.ConsumeIntegralInRange(0, 9)), 1);
    for (int64_t& d : shape) d = in.ConsumeIntegralInRange<int64_t>(-2, 12);
  }
  if (shape.size() > static_cast<size_t>(TensorView::kMaxDims)) {
    t.ndim = -1;
    return t;
  }
  t.ndim = static_cast<int32_t>(shape.size());
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[static_cast<size_t>(d)] = shape[static_cast<size_t>(d)];
    t.strides[static_cast<size_t>(d)] = stride;
    if (in.ConsumeIntegralInRange(0, 6) == 0)
      t.strides[static_cast<size_t>(d)] = in.ConsumeIntegralInRange<int64_t>(-3, 50);
    stride *=
        std::max<int64_t>(shape[static_cast<size_t>(d)], 1) + (in.ConsumeBool() ? 0 : in.ConsumeIntegralInRange(0, 3));
  }
  if (in.ConsumeIntegralInRange(0, 15) == 0) t.device = vpce::Device{vpce::DeviceType::kCUDA, 0};
  t.byte_offset = in.ConsumeIntegralInRange(0, 7) == 0 ? in.ConsumeIntegralInRange<uint64_t>(0, 7) : 0;
  // The extent the view claims: 1 + sum (shape - 1) * stride elements, if all are >= 0.
  int64_t last = 0;
  bool empty = false;
  bool sane = true;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[static_cast<size_t>(d)] <= 0) empty = true;
    if (t.shape[static_cast<size_t>(d)] < 0 || t.strides[static_cast<size_t>(d)] < 0) sane = false;
    if (t.shape[static_cast<size_t>(d)] > 0)
      last += (t.shape[static_cast<size_t>(d)] - 1) * t.strides[static_cast<size_t>(d)];
  }
  const int64_t bytes = empty ? 0 : (last + 1) * t.dtype.bytes() + static_cast<int64_t>(t.byte_offset);
  if (!sane || bytes > kMaxBytes || in.ConsumeIntegralInRange(0, 20) == 0) {
    t.data = nullptr;
    return t;
  }
  std::byte* p = arena.allocate(std::max<int64_t>(bytes, 1), in);
  t.data = p;
  if (buffer_bytes != nullptr) *buffer_bytes = bytes;
  if (output) arena.outputs.push_back({p, bytes});
  return t;
}

void require(bool condition) {
  if (!condition) __builtin_trap();
}

// An error names what was expected; nothing was written.
void check(const vpce::Status& status, const std::vector<std::vector<std::byte>>& before, const Arena& arena) {
  if (status.ok()) return;
  if (status.message().find("expected") == std::string::npos) {
    std::fprintf(stderr, "error without 'expected': %s\n", status.to_string().c_str());
    __builtin_trap();
  }
  for (size_t i = 0; i < arena.outputs.size(); ++i) {
    if (arena.outputs[i].second == 0) continue;
    require(std::memcmp(before[i].data(), arena.outputs[i].first, static_cast<size_t>(arena.outputs[i].second)) == 0);
  }
}

std::vector<std::vector<std::byte>> snapshot(const Arena& arena) {
  std::vector<std::vector<std::byte>> copies;
  for (const auto& [p, bytes] : arena.outputs) copies.emplace_back(p, p + bytes);
  return copies;
}

vpce::LossOptions fuzz_options(FuzzedDataProvider& in) {
  vpce::LossOptions o;
  const float floats[] = {0.0f, 0.1f, 0.5f, 1.0f, -0.5f, 3.0f, 1e30f, __builtin_nanf("")};
  if (in.ConsumeBool()) o.label_smoothing = floats[in.ConsumeIntegralInRange(0, 7)];
  // kMegatron, kPyTorch, kMegatronLegacy, or a value outside the enum.
  o.smoothing_semantics =
      static_cast<vpce::SmoothingSemantics>(in.ConsumeIntegralInRange(0, 3) == 3 ? 7 : in.ConsumeIntegralInRange(0, 2));
  o.ignore_index = in.ConsumeIntegralInRange<int64_t>(-101, 12);
  if (in.ConsumeBool()) o.z_loss_weight = floats[in.ConsumeIntegralInRange(0, 7)];
  if (in.ConsumeBool()) o.logit_scale = floats[in.ConsumeIntegralInRange(0, 7)];
  if (in.ConsumeBool()) o.softcap = floats[in.ConsumeIntegralInRange(0, 7)];
  o.valid_vocab_size = in.ConsumeIntegralInRange<int64_t>(-1, 14);
  o.reduction = static_cast<vpce::Reduction>(in.ConsumeIntegralInRange(-1, 3));
  o.num_threads = in.ConsumeIntegralInRange(-1, 2);
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static std::unique_ptr<vpce::ThreadGroup> group = [] {
    std::unique_ptr<vpce::ThreadGroup> g;
    require(vpce::ThreadGroup::create(1, &g).ok());
    return g;
  }();
  FuzzedDataProvider in(data, size);
  Arena arena;
  const int64_t tokens = in.ConsumeIntegralInRange<int64_t>(0, 6);
  vpce::VocabShard shard;
  shard.vocab_size = in.ConsumeIntegralInRange<int64_t>(-1, 14);
  shard.vocab_begin = in.ConsumeIntegralInRange<int64_t>(-1, 14);
  shard.vocab_end = in.ConsumeIntegralInRange<int64_t>(-1, 14);
  const int64_t cols = std::max<int64_t>(shard.vocab_end - shard.vocab_begin, 0);
  const vpce::LossOptions options = fuzz_options(in);
  const bool reduced = options.reduction == vpce::Reduction::kSum || options.reduction == vpce::Reduction::kMean;

  int64_t logits_bytes = 0;
  const TensorView logits = fuzz_view(in, arena, vpce::kFloat32, {tokens, cols}, false, &logits_bytes);
  const TensorView targets = fuzz_view(in, arena, vpce::kInt64, {tokens}, false);
  const TensorView weights = fuzz_view(in, arena, vpce::kFloat32, {tokens}, false);
  const TensorView loss = fuzz_view(in, arena, vpce::kFloat32, {reduced ? 1 : tokens}, true);
  const TensorView lse = fuzz_view(in, arena, in.ConsumeBool() ? vpce::kFloat64 : vpce::kFloat32, {tokens}, true);
  const TensorView entropy = fuzz_view(in, arena, vpce::kFloat32, {tokens}, true);
  const bool in_place = in.ConsumeBool();
  const TensorView grad = in_place ? logits : fuzz_view(in, arena, vpce::kFloat32, {tokens, cols}, true);
  const int64_t width = in.ConsumeBool() ? vpce::kStatsWidth : vpce::kStatsWidthWithExtras;
  const TensorView stats = fuzz_view(in, arena, vpce::kFloat32, {tokens, width}, true);
  const TensorView gathered = fuzz_view(in, arena, vpce::kFloat32, {1, tokens, width}, false);
  vpce::ForwardExtras extras;
  if (in.ConsumeBool()) extras.weights = &weights;
  if (in.ConsumeBool()) extras.entropy = &entropy;

  const auto* logits_buffer = static_cast<const std::byte*>(logits.data);
  const std::vector<std::byte> logits_before(logits_buffer, logits_buffer + (logits_buffer ? logits_bytes : 0));
  auto outputs_before = snapshot(arena);
  check(vpce::forward(group->communicator(0), logits, targets, shard, options, loss, lse, extras), outputs_before,
        arena);
  if (!logits_before.empty() && !in_place) {
    require(std::memcmp(logits_before.data(), logits_buffer, logits_before.size()) == 0);
  }

  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      outputs_before = snapshot(arena);
      check(vpce::backward(logits, targets, lse, loss, shard, options, grad, extras.weights), outputs_before, arena);
      break;
    case 1:
      outputs_before = snapshot(arena);
      check(vpce::calculate_local_stats(logits, targets, shard, options, stats), outputs_before, arena);
      break;
    case 2: {
      // With shards or without; shards of random count and ranges (valid or not).
      std::vector<vpce::VocabShard> shards(in.ConsumeIntegralInRange<std::size_t>(0, 3));
      for (vpce::VocabShard& s : shards) {
        s.vocab_size = in.ConsumeIntegralInRange<int64_t>(-1, 40);
        s.vocab_begin = in.ConsumeIntegralInRange<int64_t>(-2, 40);
        s.vocab_end = in.ConsumeIntegralInRange<int64_t>(-2, 42);
      }
      outputs_before = snapshot(arena);
      check(shards.empty() ? vpce::merge_stats(gathered, options, stats)
                           : vpce::merge_stats(gathered, options, stats, shards),
            outputs_before, arena);
      break;
    }
    default:
      outputs_before = snapshot(arena);
      check(vpce::calculate_loss(gathered.ndim == 3 ? stats : gathered, targets, shard.vocab_size, options, loss, lse,
                                 extras),
            outputs_before, arena);
      break;
  }
  return 0;
}
