// validate.cc: argument checks shared by every public entry point (see validate.h).
#include "validate.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <thread>

#include "common/text.h"
#include "common/values_hash.h"

namespace vpce::detail {
namespace {

std::string dim_name(const char* name, const char* field, int d) {
  return std::string(name) + "." + field + "[" + std::to_string(d) + "]";
}

// Common to both shapes of view: ndim range, device, non-negative shapes and strides,
// no overflow of the element count. `min_ndim` is 1 for matrices and 0 for vectors.
Status check_view_basics(const TensorView& t, const char* name, int min_ndim, int64_t* numel) {
  if (t.ndim < min_ndim || t.ndim > TensorView::kMaxDims) {
    return {
        Code::kInvalidArgument,
        expected_got((std::string(name) + ".ndim").c_str(),
                     std::to_string(min_ndim) + " to " + std::to_string(TensorView::kMaxDims),
                     t.ndim < 0 ? "a view with too many dimensions or mismatched strides" : std::to_string(t.ndim))};
  }
  if (t.device.type != DeviceType::kCPU && t.device.type != DeviceType::kCUDA) {
    return {Code::kUnsupported,
            expected_got((std::string(name) + ".device").c_str(), "cpu or cuda", to_string(t.device))};
  }
  int64_t count = 1;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) {
      return {Code::kInvalidArgument,
              expected_got(dim_name(name, "shape", d).c_str(), ">= 0", std::to_string(t.shape[d]))};
    }
    if (__builtin_mul_overflow(count, t.shape[d], &count)) {
      return {Code::kInvalidArgument, expected_got((std::string(name) + ".shape").c_str(),
                                                   "an element count that fits in 64 bits", "an overflowing product")};
    }
  }
  for (int d = 0; d < t.ndim && count > 0; ++d) {  // an empty tensor's strides do not matter
    if (t.shape[d] > 1 && t.strides[d] <= 0) {
      return {Code::kInvalidArgument,
              expected_got(dim_name(name, "strides", d).c_str(), "a positive stride", std::to_string(t.strides[d]))};
    }
  }
  *numel = count;
  return {};
}

// Where user memory can lie: on x86-64 below 2^63 (the upper half is the kernel's); elsewhere
// anywhere (AArch64's top-byte tags may set bit 63 of a valid pointer).
#if defined(__x86_64__)
constexpr uintptr_t kUserLimit = uintptr_t{1} << 63;
constexpr const char* kUserLimitText = " (below 2^63)";
#else
constexpr uintptr_t kUserLimit = ~uintptr_t{0};
constexpr const char* kUserLimitText = "";
#endif

// data + byte_offset aligned to the dtype; it and the end of the view's `extent` bytes after it
// inside the address space user memory can hold (without wrapping, below kUserLimit); *first
// set to it (for an empty view, which reads nothing, data where the sum would wrap). Computed
// on integers: a pointer sum that overflows is undefined behaviour, and a view past the end of
// memory crashed the kernels.
Status check_address(const TensorView& t, const char* name, int64_t numel, int64_t extent, char** first) {
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  uintptr_t address = 0, end = 0;
  *first = static_cast<char*>(t.data);
  if (numel == 0) {
    if (t.data != nullptr && !__builtin_add_overflow(base, t.byte_offset, &address)) {
      *first = reinterpret_cast<char*>(address);
    }
    return {};
  }
  if (t.data == nullptr) {
    return {Code::kInvalidArgument, expected_got((std::string(name) + ".data").c_str(), "a non-null pointer", "null")};
  }
  if (__builtin_add_overflow(base, t.byte_offset, &address) ||
      __builtin_add_overflow(address, static_cast<uintptr_t>(extent), &end) || end > kUserLimit) {
    return {Code::kInvalidArgument,
            expected_got((std::string(name) + ".byte_offset").c_str(),
                         "data + byte_offset + the view's " + std::to_string(extent) +
                             " bytes inside the address space" + kUserLimitText,
                         std::to_string(t.byte_offset) + " (data " + hex_address(t.data) + ")")};
  }
  const int bytes = t.dtype.bytes();
  if (bytes > 0 && address % static_cast<uintptr_t>(bytes) != 0) {
    return {Code::kInvalidArgument,
            expected_got(
                name, "data + byte_offset aligned to " + std::to_string(bytes) + " bytes (" + to_string(t.dtype) + ")",
                "address " + hex_address(reinterpret_cast<const void*>(address)))};
  }
  *first = reinterpret_cast<char*>(address);
  return {};
}

// Checks that the dimensions [0, end) with more than one element are nested (each
// stride is the next one's stride times its size) and returns the innermost stride of
// them, or `fallback` if none has more than one element.
Status collapse(const TensorView& t, const char* name, int end, int64_t fallback, int64_t* stride) {
  int inner = -1;      // the next dimension inwards that is not of size 1
  int innermost = -1;  // the innermost such dimension: its stride is the collapsed one
  for (int d = end - 1; d >= 0; --d) {
    if (t.shape[d] == 1) continue;
    if (innermost < 0) innermost = d;
    if (inner >= 0) {
      int64_t expected = 0;
      if (__builtin_mul_overflow(t.strides[inner], t.shape[inner], &expected) || t.strides[d] != expected) {
        return {Code::kInvalidArgument,
                expected_got(dim_name(name, "strides", d).c_str(),
                             std::to_string(expected) + " (the leading dimensions must collapse "
                                                        "to one stride)",
                             std::to_string(t.strides[d]))};
      }
    }
    inner = d;
  }
  *stride = innermost >= 0 ? t.strides[innermost] : fallback;
  return {};
}

// Last byte + 1 of `count` strided elements, checking for 64-bit overflow.
bool extent_bytes(int64_t count, int64_t stride, int64_t tail, int bytes, int64_t* out) {
  if (count == 0) {
    *out = 0;
    return true;
  }
  int64_t elements = 0;
  if (__builtin_mul_overflow(count - 1, stride, &elements)) return false;
  if (__builtin_add_overflow(elements, tail, &elements)) return false;
  return !__builtin_mul_overflow(elements, static_cast<int64_t>(bytes), out);
}

}  // namespace

Status check_thread_count(const char* name, int num_threads) {
  // (OpenMP crashes or exits when it cannot make the threads asked for.)
  const int most = 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (num_threads >= 0 && num_threads <= most) return {};
  return {Code::kInvalidArgument,
          expected_got(name,
                       "in [0, " + std::to_string(most) + "] (0: OpenMP's default; at most 4 x this machine's " +
                           std::to_string(most / 4) + " hardware threads)",
                       std::to_string(num_threads))};
}

std::string expected_got(const char* name, const std::string& expected, const std::string& got) {
  return std::string(name) + ": expected " + expected + ", got " + got;
}

const char* RowMatrix::end_byte() const {
  if (rows == 0 || cols == 0) return base;
  return base + ((rows - 1) * row_stride + cols) * dtype.bytes();
}

const char* TokenVector::end_byte() const {
  if (n == 0) return base;
  return base + ((n - 1) * stride + 1) * dtype.bytes();
}

Status as_row_matrix(const TensorView& t, const char* name, RowMatrix* out) {
  int64_t numel = 0;
  if (Status s = check_view_basics(t, name, 1, &numel); !s.ok()) return s;
  const int last = t.ndim - 1;
  const int64_t cols = t.shape[last];
  if (numel > 0 && cols > 1 && t.strides[last] != 1) {
    return {Code::kInvalidArgument,
            expected_got(dim_name(name, "strides", last).c_str(), "1 (the vocabulary dimension must be contiguous)",
                         std::to_string(t.strides[last]))};
  }
  int64_t rows = 1;
  for (int d = 0; d < last; ++d) rows *= t.shape[d];  // cannot overflow: numel did not
  int64_t row_stride = cols;
  if (numel > 0) {
    if (Status s = collapse(t, name, last, cols, &row_stride); !s.ok()) return s;
  }
  if (rows > 1 && row_stride < cols) {
    return {Code::kInvalidArgument,
            expected_got((std::string(name) + " row stride").c_str(),
                         ">= " + std::to_string(cols) + " (rows must not overlap)", std::to_string(row_stride))};
  }
  int64_t extent = 0;
  if (numel > 0 && !extent_bytes(rows, row_stride, cols, t.dtype.bytes(), &extent)) {
    return {Code::kInvalidArgument, expected_got(name, "a memory extent that fits in 64 bits", "an overflowing one")};
  }
  char* first = nullptr;
  if (Status s = check_address(t, name, numel, extent, &first); !s.ok()) return s;
  *out = RowMatrix{first, t.dtype, rows, cols, row_stride};
  return {};
}

Status as_token_vector(const TensorView& t, const char* name, int64_t n, TokenVector* out) {
  int64_t numel = 0;
  if (Status s = check_view_basics(t, name, 0, &numel); !s.ok()) return s;
  if (numel != n) {
    return {Code::kInvalidArgument,
            expected_got((std::string(name) + ".shape").c_str(), std::to_string(n) + " elements (one per token)",
                         std::to_string(numel) + " elements")};
  }
  int64_t stride = 1;
  if (numel > 0) {
    if (Status s = collapse(t, name, t.ndim, 1, &stride); !s.ok()) return s;
  }
  int64_t extent = 0;
  if (!extent_bytes(n, stride, 1, t.dtype.bytes(), &extent)) {
    return {Code::kInvalidArgument, expected_got(name, "a memory extent that fits in 64 bits", "an overflowing one")};
  }
  char* first = nullptr;
  if (Status s = check_address(t, name, numel, extent, &first); !s.ok()) return s;
  *out = TokenVector{first, t.dtype, n, stride};
  return {};
}

Status check_dtype(const char* name, DataType actual, std::initializer_list<DataType> allowed,
                   const char* allowed_text) {
  for (const DataType& a : allowed) {
    if (actual == a) return {};
  }
  return {Code::kInvalidArgument,
          expected_got((std::string(name) + ".dtype").c_str(), allowed_text, to_string(actual))};
}

Status check_shard(const VocabShard& shard, int64_t logits_cols, const char* logits_name) {
  if (shard.vocab_size < 1 || shard.vocab_size > INT32_MAX) {
    return {Code::kInvalidArgument,
            expected_got("shard.vocab_size", "a value in [1, 2^31 - 1]", std::to_string(shard.vocab_size))};
  }
  if (shard.vocab_begin < 0 || shard.vocab_begin > shard.vocab_end || shard.vocab_end > shard.vocab_size) {
    return {Code::kInvalidArgument,
            expected_got("shard", "0 <= vocab_begin <= vocab_end <= vocab_size",
                         "[" + std::to_string(shard.vocab_begin) + ", " + std::to_string(shard.vocab_end) + ") of " +
                             std::to_string(shard.vocab_size))};
  }
  if (logits_cols != shard.vocab_end - shard.vocab_begin) {
    return {Code::kInvalidArgument,
            expected_got((std::string(logits_name) + ".shape[-1]").c_str(),
                         std::to_string(shard.vocab_end - shard.vocab_begin) + " (shard.vocab_end - shard.vocab_begin)",
                         std::to_string(logits_cols))};
  }
  return {};
}

Status check_options(const LossOptions& options, const VocabShard& shard) {
  const int64_t vocab_size = shard.vocab_size;
  // PyTorch's F.cross_entropy takes 1 (the target's weight is then 0, the uniform one 1);
  // Megatron's a V / (V - 1) would exceed 1.
  const float a = options.label_smoothing;
  const bool pytorch = options.smoothing_semantics == SmoothingSemantics::kPyTorch;
  const bool legacy = options.smoothing_semantics == SmoothingSemantics::kMegatronLegacy;
  if (!(a >= 0.0f && (a < 1.0f || (pytorch && a == 1.0f)))) {
    return {Code::kInvalidArgument,
            expected_got("options.label_smoothing",
                         pytorch ? "a value in [0, 1] (PyTorch's semantics)" : "a value in [0, 1)", number_text(a))};
  }
  const auto semantics = static_cast<int32_t>(options.smoothing_semantics);
  if (semantics < 0 || semantics > 2) {
    return {Code::kInvalidArgument,
            expected_got("options.smoothing_semantics", "kMegatron (0), kPyTorch (1) or kMegatronLegacy (2)",
                         std::to_string(semantics))};
  }
  const auto reduction = static_cast<int32_t>(options.reduction);
  if (reduction < 0 || reduction > 2) {
    return {Code::kInvalidArgument,
            expected_got("options.reduction", "kNone (0), kSum (1) or kMean (2)", std::to_string(reduction))};
  }
  if (!(options.z_loss_weight >= 0.0f) || !std::isfinite(options.z_loss_weight)) {
    return {Code::kInvalidArgument,
            expected_got("options.z_loss_weight", "a finite value >= 0", number_text(options.z_loss_weight))};
  }
  if (!(options.logit_scale > 0.0f) || !std::isfinite(options.logit_scale)) {
    return {Code::kInvalidArgument,
            expected_got("options.logit_scale", "a finite value > 0", number_text(options.logit_scale))};
  }
  // A subnormal cap would make 1 / softcap overflow to inf (and the loss NaN).
  const bool softcap_ok = options.softcap == 0.0f ||
                          (options.softcap >= std::numeric_limits<float>::min() && std::isfinite(options.softcap));
  if (!softcap_ok) {
    return {Code::kInvalidArgument,
            expected_got("options.softcap",
                         "0 (off) or a finite value >= " + number_text(std::numeric_limits<float>::min()) +
                             " (the smallest normal float, so that 1 / softcap is finite)",
                         number_text(options.softcap))};
  }
  if (options.valid_vocab_size < 0 || options.valid_vocab_size > vocab_size) {
    return {Code::kInvalidArgument, expected_got("options.valid_vocab_size",
                                                 "a value in [0, " + std::to_string(vocab_size) + "] (0: every column)",
                                                 std::to_string(options.valid_vocab_size))};
  }
  const int64_t valid = options.valid_vocab_size > 0 ? options.valid_vocab_size : vocab_size;
  if (a > 0.0f && options.smoothing_semantics == SmoothingSemantics::kMegatron && valid < 2) {
    return {Code::kInvalidArgument,
            expected_got("valid vocabulary size", ">= 2 when Megatron label smoothing is used", std::to_string(valid))};
  }
  if (a > 0.0f && legacy) {
    // Megatron's legacy smoothing spreads over the shard's own columns: a K / (K - 1).
    const int64_t begin = std::clamp<int64_t>(shard.vocab_begin, 0, vocab_size);
    const int64_t end = std::clamp<int64_t>(shard.vocab_end, begin, vocab_size);
    const int64_t shard_valid = std::clamp<int64_t>(valid - begin, 0, end - begin);
    if (shard_valid < 2) {
      return {Code::kInvalidArgument, expected_got("shard's valid columns",
                                                   ">= 2 when Megatron's legacy label smoothing is used (it divides "
                                                   "by K - 1, K the shard's columns)",
                                                   std::to_string(shard_valid))};
    }
  }
  if (Status s = check_thread_count("options.num_threads", options.num_threads); !s.ok()) return s;
  return {};
}

Status check_not_legacy_smoothing(const LossOptions& options, const char* function) {
  if (options.smoothing_semantics != SmoothingSemantics::kMegatronLegacy) return {};
  return {Code::kInvalidArgument,
          expected_got("options.smoothing_semantics",
                       std::string("kMegatron or kPyTorch in ") + function +
                           " (the legacy smoothing needs the rank's shard: use forward() and backward())",
                       "kMegatronLegacy")};
}

Status check_targets(const TokenVector& targets, int64_t valid_vocab, int64_t ignore_index, uint64_t* hash) {
  const bool wide = targets.dtype == kInt64;
  for (int64_t i = 0; i < targets.n; ++i) {
    const int64_t y = wide ? targets.at<int64_t>(i) : targets.at<int32_t>(i);
    if (y != ignore_index && (y < 0 || y >= valid_vocab)) {
      return {Code::kInvalidArgument, expected_got("targets",
                                                   "values in [0, " + std::to_string(valid_vocab) +
                                                       ") or ignore_index " + std::to_string(ignore_index),
                                                   std::to_string(y) + " at token " + std::to_string(i))};
    }
  }
  *hash = extend_values_hash<int64_t>(*hash, targets.n, [&](int64_t i) {
    return wide ? targets.at<int64_t>(i) : static_cast<int64_t>(targets.at<int32_t>(i));
  });
  return {};
}

Status as_weights(const TensorView* weights, int64_t n, TokenVector* out) {
  *out = TokenVector{};
  if (weights == nullptr) return {};
  if (Status s = check_dtype("weights", weights->dtype, {kFloat32}, "float32"); !s.ok()) return s;
  return as_token_vector(*weights, "weights", n, out);
}

Status check_weights(const TensorView* weights, int64_t n, TokenVector* out, uint64_t* hash) {
  TokenVector w;
  if (Status s = as_weights(weights, n, &w); !s.ok()) return s;
  *out = w;
  if (weights == nullptr) return {};
  for (int64_t i = 0; i < n; ++i) {
    const float value = w.at<float>(i);
    // Non-negative, so that a mean's denominator is 0 only when every counted weight is.
    if (!std::isfinite(value) || value < 0.0f) {
      return {Code::kInvalidArgument,
              expected_got("weights", "finite values >= 0", number_text(value) + " at token " + std::to_string(i))};
    }
  }
  *out = w;
  *hash = extend_values_hash<uint32_t>(*hash, n, [&](int64_t i) { return std::bit_cast<uint32_t>(w.at<float>(i)); });
  return {};
}

bool overlaps(const char* a_begin, const char* a_end, const char* b_begin, const char* b_end) {
  if (a_begin == a_end || b_begin == b_end) return false;
  return a_begin < b_end && b_begin < a_end;
}

}  // namespace vpce::detail

namespace vpce::detail {

Status check_device(const TensorView& t, const char* name, Device expected) {
  if (t.device.type == expected.type && (expected.type == DeviceType::kCPU || t.device.id == expected.id)) return {};
  return {Code::kInvalidArgument, expected_got((std::string(name) + ".device").c_str(),
                                               to_string(expected) + " (the logits' device)", to_string(t.device))};
}

Status check_loss_inputs(const TensorView& logits, const TensorView& targets, const TensorView* weights,
                         const VocabShard& shard, const LossOptions& options, LossInputs* out) {
  LossInputs in;
  if (Status s = device_supported(logits.device, "logits"); !s.ok()) return s;
  if (Status s = check_dtype("logits", logits.dtype, {kFloat32, kBFloat16, kFloat16}, "float32, bfloat16 or float16");
      !s.ok()) {
    return s;
  }
  if (Status s = as_row_matrix(logits, "logits", &in.logits); !s.ok()) return s;
  if (Status s = check_shard(shard, in.logits.cols, "logits"); !s.ok()) return s;
  if (Status s = check_options(options, shard); !s.ok()) return s;
  if (Status s = check_dtype("targets", targets.dtype, {kInt32, kInt64}, "int32 or int64"); !s.ok()) {
    return s;
  }
  if (Status s = as_token_vector(targets, "targets", in.logits.rows, &in.targets); !s.ok()) {
    return s;
  }
  if (Status s = check_device(targets, "targets", logits.device); !s.ok()) return s;
  if (weights != nullptr) {
    if (Status s = check_device(*weights, "weights", logits.device); !s.ok()) return s;
  }
  in.inputs_hash = kValuesHashSeed;
  if (logits.device.type != DeviceType::kCPU) {
    // Device memory: the values are checked by the kernels (see loss.h), not read here.
    if (Status s = as_weights(weights, in.logits.rows, &in.weights); !s.ok()) return s;
    *out = in;
    return {};
  }
  const int64_t valid = options.valid_vocab_size > 0 ? options.valid_vocab_size : shard.vocab_size;
  if (Status s = check_targets(in.targets, valid, options.ignore_index, &in.inputs_hash); !s.ok()) {
    return s;
  }
  if (Status s = check_weights(weights, in.logits.rows, &in.weights, &in.inputs_hash); !s.ok()) {
    return s;
  }
  *out = in;
  return {};
}

Status check_loss_output(const TensorView& loss, const char* name, int64_t n, Reduction reduction, TokenVector* out) {
  if (Status s = check_dtype(name, loss.dtype, {kFloat32}, "float32"); !s.ok()) return s;
  if (reduction != Reduction::kNone && loss.ndim >= 0 && loss.ndim <= TensorView::kMaxDims && loss.numel() != 1) {
    return {Code::kInvalidArgument, expected_got((std::string(name) + ".shape").c_str(), "1 element (a reduced loss)",
                                                 std::to_string(loss.numel()) + " elements")};
  }
  return as_token_vector(loss, name, reduction == Reduction::kNone ? n : 1, out);
}

Status as_stats_matrix(const TensorView& t, const char* name, int64_t rows, int64_t width, RowMatrix* out) {
  RowMatrix m;
  if (Status s = check_dtype(name, t.dtype, {kFloat32}, "float32"); !s.ok()) return s;
  if (Status s = as_row_matrix(t, name, &m); !s.ok()) return s;
  if (m.rows != rows || m.cols != width) {
    return {Code::kInvalidArgument,
            expected_got((std::string(name) + ".shape").c_str(),
                         "[" + std::to_string(rows) + ", " + std::to_string(width) + "] (one stats row per token)",
                         "[" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "]")};
  }
  *out = m;
  return {};
}

Status as_float_tokens(const TensorView& t, const char* name, int64_t n, TokenVector* out) {
  if (Status s = check_dtype(name, t.dtype, {kFloat32}, "float32"); !s.ok()) return s;
  return as_token_vector(t, name, n, out);
}

Status as_lse_tokens(const TensorView& t, const char* name, int64_t n, TokenVector* out) {
  if (Status s = check_dtype(name, t.dtype, {kFloat64, kFloat32}, "float64 or float32"); !s.ok()) return s;
  return as_token_vector(t, name, n, out);
}

Status check_no_overlap(const std::vector<NamedRegion>& outputs, const std::vector<NamedRegion>& inputs) {
  auto clash = [](const NamedRegion& a, const NamedRegion& b) -> Status {
    if (a.begin == nullptr || b.begin == nullptr || !overlaps(a.begin, a.end, b.begin, b.end)) return {};
    return {Code::kInvalidArgument,
            expected_got(a.name, std::string("memory that does not overlap ") + b.name, "an overlapping buffer")};
  };
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (std::size_t j = i + 1; j < outputs.size(); ++j) {
      if (Status s = clash(outputs[i], outputs[j]); !s.ok()) return s;
    }
    for (const NamedRegion& in : inputs) {
      if (Status s = clash(outputs[i], in); !s.ok()) return s;
    }
  }
  return {};
}

Status check_forward_outputs(int64_t n, Device device, const LossOptions& options, const TensorView& loss,
                             const TensorView& lse, const ForwardExtras& extras, const std::vector<NamedRegion>& inputs,
                             LossOutputs* out) {
  const std::pair<const TensorView*, const char*> views[] = {
      {&loss, "loss"}, {&lse, "lse"}, {extras.target_is_argmax, "target_is_argmax"}, {extras.entropy, "entropy"}};
  for (const auto& [view, name] : views) {
    if (view == nullptr) continue;
    if (Status s = check_device(*view, name, device); !s.ok()) return s;
  }
  if (Status s = check_loss_output(loss, "loss", n, options.reduction, &out->loss); !s.ok()) return s;
  if (Status s = as_lse_tokens(lse, "lse", n, &out->lse); !s.ok()) return s;
  if (extras.target_is_argmax != nullptr) {
    if (Status s = as_float_tokens(*extras.target_is_argmax, "target_is_argmax", n, &out->target_is_argmax); !s.ok()) {
      return s;
    }
  }
  if (extras.entropy != nullptr) {
    if (Status s = as_float_tokens(*extras.entropy, "entropy", n, &out->entropy); !s.ok()) return s;
  }
  return check_no_overlap({region_of("loss", out->loss), region_of("lse", out->lse),
                           region_of("target_is_argmax", out->target_is_argmax), region_of("entropy", out->entropy)},
                          inputs);
}

Status check_grad_logits(const TensorView& grad_logits, const RowMatrix& logits, const std::vector<NamedRegion>& inputs,
                         RowMatrix* out) {
  if (Status s = check_dtype("grad_logits", grad_logits.dtype, {kFloat32, kBFloat16, kFloat16},
                             "float32, bfloat16 or float16");
      !s.ok()) {
    return s;
  }
  RowMatrix grad;
  if (Status s = as_row_matrix(grad_logits, "grad_logits", &grad); !s.ok()) return s;
  const int64_t n = logits.rows;
  if (grad.rows != n || grad.cols != logits.cols) {
    return {Code::kInvalidArgument,
            expected_got("grad_logits.shape",
                         std::to_string(n) + " rows of " + std::to_string(logits.cols) + " (the logits' shape)",
                         std::to_string(grad.rows) + " rows of " + std::to_string(grad.cols))};
  }
  const bool in_place = grad.base == logits.base;
  if (in_place && n > 0 && logits.cols > 0 &&
      (grad.dtype != logits.dtype || (n > 1 && grad.row_stride != logits.row_stride))) {
    return {Code::kInvalidArgument,
            expected_got("grad_logits",
                         "for an in-place gradient, the logits' dtype " + to_string(logits.dtype) + " and row stride " +
                             std::to_string(logits.row_stride),
                         to_string(grad.dtype) + " and row stride " + std::to_string(grad.row_stride))};
  }
  if (!in_place && overlaps(grad.begin_byte(), grad.end_byte(), logits.begin_byte(), logits.end_byte())) {
    return {Code::kInvalidArgument,
            expected_got("grad_logits", "memory that does not overlap the logits (or exactly the logits, for in place)",
                         "an overlapping buffer")};
  }
  if (Status s = check_no_overlap({region_of("grad_logits", grad)}, inputs); !s.ok()) return s;
  *out = grad;
  return {};
}

}  // namespace vpce::detail
