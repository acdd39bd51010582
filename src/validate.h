// validate.h: argument checks shared by every public entry point.
//
// Each check turns a TensorView into the plain description a kernel takes (a matrix of
// rows with one row stride, or a vector of tokens with one stride), or returns
// kInvalidArgument / kUnsupported with a message naming the argument, the expected and the
// actual value. Nothing here reads tensor contents except check_targets.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/token_math.h"
#include "vpce/options.h"
#include "vpce/status.h"
#include "vpce/tensor.h"

namespace vpce::detail {

// rows x cols elements of `dtype`, row r at base + r * row_stride elements, columns
// contiguous.
struct RowMatrix {
  char* base = nullptr;
  DataType dtype{};
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;

  template <class T>
  T* row(int64_t r) const {
    return reinterpret_cast<T*>(base) + r * row_stride;
  }
  // [lo, hi) bytes touched, for overlap checks; empty when there are no elements.
  const char* begin_byte() const { return base; }
  const char* end_byte() const;
};

// n elements of `dtype`, element i at base + i * stride elements.
struct TokenVector {
  char* base = nullptr;
  DataType dtype{};
  int64_t n = 0;
  int64_t stride = 0;

  template <class T>
  T& at(int64_t i) const {
    return reinterpret_cast<T*>(base)[i * stride];
  }
  const char* end_byte() const;
};

// A CPU tensor of ndim >= 1 whose last dimension is contiguous and whose leading
// dimensions collapse to one row stride >= cols. `name` is used in messages.
Status as_row_matrix(const TensorView& t, const char* name, RowMatrix* out);
// A CPU tensor of exactly n elements whose dimensions collapse to one stride (ndim 0 to 8).
Status as_token_vector(const TensorView& t, const char* name, int64_t n, TokenVector* out);

// dtype is one of `allowed`; `allowed_text` lists them for the message.
Status check_dtype(const char* name, DataType actual, std::initializer_list<DataType> allowed,
                   const char* allowed_text);

// 0 <= begin <= end <= size, 1 <= size < 2^31, cols == end - begin.
Status check_shard(const VocabShard& shard, int64_t logits_cols, const char* logits_name);
// Every option in its range, given this rank's shard (see LossOptions).
Status check_options(const LossOptions& options, const VocabShard& shard);
// The staged functions' refusal of Megatron's legacy smoothing (they do not know the rank's
// shard); `function` names the caller.
Status check_not_legacy_smoothing(const LossOptions& options, const char* function);

// Every target in [0, valid_vocab) or equal to ignore_index; also folds the targets'
// values into the 64-bit hash `hash` (the same for int32 and int64 storage).
Status check_targets(const TokenVector& targets, int64_t valid_vocab, int64_t ignore_index, uint64_t* hash);

// Optional per-token weights: absent (null) or float32, one per token, all finite; folds
// their bits into `hash`. `out` gets base == nullptr when absent.
Status check_weights(const TensorView* weights, int64_t n, TokenVector* out, uint64_t* hash);
// The weights' view alone (float32, n elements), without reading the values: for device
// memory. Absent weights give an absent vector.
Status as_weights(const TensorView* weights, int64_t n, TokenVector* out);

// The byte ranges of a and b intersect.
bool overlaps(const char* a_begin, const char* a_end, const char* b_begin, const char* b_end);

// "expected X, got Y" message helper.
std::string expected_got(const char* name, const std::string& expected, const std::string& got);

// A thread count for OpenMP: 0 (its default) up to 4 x this machine's hardware threads.
Status check_thread_count(const char* name, int num_threads);

}  // namespace vpce::detail

namespace vpce::detail {

// The validated inputs shared by the forward stages and the backward.
// `name`.device equals `expected` (kInvalidArgument naming both otherwise).
Status check_device(const TensorView& t, const char* name, Device expected);

// Whether this build and machine can compute on `device`: the CPU always; CUDA when vpce
// was built with it and the device exists (kUnsupported naming `name`.device otherwise).
// Defined in cuda/dispatch.cu, or in cuda/without_cuda.cc for builds without CUDA.
Status device_supported(Device device, const char* name);

// For CUDA tensors: `data` is memory of `device` (or managed), not host memory.
Status check_device_pointer(const TensorView& t, const char* name);

struct LossInputs {
  RowMatrix logits;
  TokenVector targets;
  TokenVector weights;       // base == nullptr when absent
  uint64_t inputs_hash = 0;  // of the targets' and the weights' values
};

// logits [..., Vr] fp32/bf16/fp16 on the CPU, targets int32/int64 with one per row and
// values in [0, Vv) or ignore_index, optional weights, the shard, and the options.
Status check_loss_inputs(const TensorView& logits, const TensorView& targets, const TensorView* weights,
                         const VocabShard& shard, const LossOptions& options, LossInputs* out);

// The loss output: float32 with n elements for Reduction::kNone, one element otherwise.
Status check_loss_output(const TensorView& loss, const char* name, int64_t n, Reduction reduction, TokenVector* out);

// A float32 [rows, width] stats tensor (width 4, or 6 with the extras).
Status as_stats_matrix(const TensorView& t, const char* name, int64_t rows, int64_t width, RowMatrix* out);

// A float32 tensor of n elements, one per token.
Status as_float_tokens(const TensorView& t, const char* name, int64_t n, TokenVector* out);
// The lse, one per token: float32, or float64 (which keeps the gradient at fp32's accuracy up
// to |lse| of about 1e9: GradientConstants).
Status as_lse_tokens(const TensorView& t, const char* name, int64_t n, TokenVector* out);
inline LseTokens lse_tokens(const TokenVector& v) { return {v.base, v.stride, v.dtype == kFloat64}; }

// A named byte range [begin, end) of an argument, for the overlap checks (begin null: absent).
struct NamedRegion {
  const char* name;
  const char* begin;
  const char* end;
};
inline NamedRegion region_of(const char* name, const TokenVector& v) { return {name, v.base, v.end_byte()}; }
inline NamedRegion region_of(const char* name, const RowMatrix& m) { return {name, m.begin_byte(), m.end_byte()}; }

// `outputs` overlap neither each other nor `inputs` (kInvalidArgument naming both).
Status check_no_overlap(const std::vector<NamedRegion>& outputs, const std::vector<NamedRegion>& inputs);

// The gradient of the logits [rows, cols]: fp32/bf16/fp16 with the logits' shape, either the
// logits' own view (in place: the same data, dtype and row stride) or memory overlapping
// neither the logits nor `inputs` (the backward's other arguments).
Status check_grad_logits(const TensorView& grad_logits, const RowMatrix& logits, const std::vector<NamedRegion>& inputs,
                         RowMatrix* out);

// The forward's outputs, validated.
struct LossOutputs {
  TokenVector loss;              // [N] for kNone, [1] otherwise
  TokenVector lse;               // [N]
  TokenVector target_is_argmax;  // [N] or absent (needs W = 6)
  TokenVector entropy;           // [N] or absent (needs W = 6)
};

// The forward's outputs for n tokens: float32 on `device`, the loss one per token (one
// element for a reduction), lse and the extras one per token, overlapping neither each other
// nor `inputs`.
Status check_forward_outputs(int64_t n, Device device, const LossOptions& options, const TensorView& loss,
                             const TensorView& lse, const ForwardExtras& extras, const std::vector<NamedRegion>& inputs,
                             LossOutputs* out);

}  // namespace vpce::detail
