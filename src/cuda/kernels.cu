// cuda/kernels.cu: the CUDA kernels of the forward and backward, and their launchers.
//
// One thread block of kThreads per token row. Rows are read with 16-byte vector loads
// (after a scalar head up to the first 16-byte boundary), every thread folding its
// elements into an online (max, sum of exp) in fp32, the block combining the threads' parts
// in a fixed tree in fp64, so results are deterministic. The per-token arithmetic (merge,
// loss, gradient constants) is src/common/token_math.h, the same code as the CPU's.
// Nothing here synchronises with the host: every launch is on the caller's stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device.h"
#include "device_common.cuh"

namespace vpce::detail::cuda {
namespace {

using namespace cuda_common;  // NOLINT: the shared device arithmetic, unqualified

// Calls f(column, value) for every element of row[0, cols), 16-byte vectors where aligned,
// thread t taking vectors t, t + kThreads, ...
template <class T, class F>
__device__ __forceinline__ void for_each_element(const T* row, int64_t cols, F&& f) {
  constexpr int kVector = 16 / sizeof(T);
  const auto address = reinterpret_cast<uintptr_t>(row);
  int64_t head = static_cast<int64_t>(((16 - address % 16) % 16) / sizeof(T));
  if (address % sizeof(T) != 0) head = cols;  // misaligned elements: all scalar
  head = head < cols ? head : cols;
  for (int64_t v = threadIdx.x; v < head; v += kThreads) f(v, to_float(row[v]));
  const int64_t vectors = (cols - head) / kVector;
  const auto* body = reinterpret_cast<const uint4*>(row + head);
  for (int64_t k = threadIdx.x; k < vectors; k += kThreads) {
    const uint4 bits = body[k];
    const T* e = reinterpret_cast<const T*>(&bits);
#pragma unroll
    for (int j = 0; j < kVector; ++j) f(head + k * kVector + j, to_float(e[j]));
  }
  for (int64_t v = head + vectors * kVector + threadIdx.x; v < cols; v += kThreads) f(v, to_float(row[v]));
}

// logits [rows, cols] (row stride ld) -> stats [rows, width] (row stride width). kPlain: no
// transform, label smoothing or extras (fold_row_plain).
template <class T, bool kPlain>
__global__ void __launch_bounds__(kThreads)
    local_stats_kernel(const T* logits, int64_t ld, int64_t cols, int64_t valid, TokenInputs tokens,
                       int64_t vocab_begin, LossParams params, float* stats, int64_t width, RankHeader* header) {
  const int64_t i = blockIdx.x;
  const T* row = logits + i * ld;
  const Transform t = transform_of(params, i);
  const bool sum_logits = params.with_sum_logits();
  const bool extras = width >= kStatsWidthWithExtras;
  Part p = empty_part();
  if constexpr (kPlain) {
    p = fold_row_plain(row, valid);
  } else {
    for_each_element(row, valid, [&](int64_t v, float x) {
      fold_element(p, t.apply(x), static_cast<int32_t>(v), sum_logits, extras);
    });
  }
  p = block_combine(p);
  if (threadIdx.x != 0) return;
  const int64_t y = tokens.target(i);
  tokens.flag_bad(i, y, params, header);
  const int64_t column = y - vocab_begin;
  float* out = stats + i * width;
  out[0] = p.max;
  out[1] = static_cast<float>(p.sum_exp);
  out[2] = column >= 0 && column < valid ? t.apply(to_float(row[column])) : -INFINITY;
  // The mean of the logits relative to the max (token_math.h), from the fp64 sum of z: the
  // column count times the max subtracted in fp64.
  out[3] = sum_logits ? logit_half_mean(rebased_logit_sum(p.sum_logits, valid, -INFINITY, p.max), valid) : 0.0f;
  if (extras) {
    out[4] = int_as_float_bits(p.argmax < 0 ? -1 : static_cast<int32_t>(p.argmax + vocab_begin));
    out[5] = static_cast<float>(p.weighted);
  }
  if (width == kStatsWidthWithSquares) {
    out[6] = static_cast<float>(p.squares);
    out[7] = 0.0f;
  }
}

// Rank r's valid columns, from its header (just before its stats in the gathered payloads),
// for weighing its mean of logits; not needed without label smoothing (the means are 0).
struct HeaderColumns {
  const float* gathered;
  int64_t rank_stride;
  LossParams params;
  __device__ bool known() const { return params.with_sum_logits(); }
  __device__ int64_t operator()(int r) const {
    const char* stats = reinterpret_cast<const char*>(gathered + r * rank_stride);
    const auto* h = reinterpret_cast<const RankHeader*>(stats - sizeof(RankHeader));
    return merged_mean_columns(h->vocab_begin, h->vocab_end, params);
  }
};

// gathered: ranks' stats [rows, width], rank r's at gathered + r * rank_stride floats, each
// after its header -> merged [rows, width].
__global__ void merge_kernel(const float* gathered, int64_t rank_stride, int ranks, int64_t rows, int64_t width,
                             LossParams params, float* merged) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  const HeaderColumns columns{gathered, rank_stride, params};
  merge_token(gathered + i * width, rank_stride, ranks, width, columns, merged + i * width);
}

// merged [rows, width] -> loss (per token, or per-token terms into `terms` for a
// reduction), lse, extras. Poisons the outputs with NaN when the device found an error.
__global__ void loss_kernel(const float* merged, int64_t rows, int64_t width, TokenInputs tokens, LossParams params,
                            float* loss, int64_t loss_stride, double* terms, LseTokens lse, float* target_is_argmax,
                            int64_t argmax_stride, float* entropy, int64_t entropy_stride, const DeviceError* error) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  TokenLoss t = token_loss(merged + i * width, tokens.target(i), static_cast<double>(tokens.weight(i)), params,
                           width >= kStatsWidthWithExtras);
  if (error->code != 0) {
    t.weighted_loss = NAN;
    t.lse = NAN;
    t.entropy = NAN;
    t.target_is_argmax = NAN;
  }
  lse.set(i, t.lse);
  if (target_is_argmax != nullptr) target_is_argmax[i * argmax_stride] = t.target_is_argmax;
  if (entropy != nullptr) entropy[i * entropy_stride] = t.entropy;
  if (params.reduction == Reduction::kNone) {
    loss[i * loss_stride] = static_cast<float>(t.weighted_loss);
  } else {
    terms[i] = t.weighted_loss;
  }
}

// merged [rows, 6] -> the RL outputs (each optional). NaN when the device found an error.
__global__ void policy_kernel(const float* merged, int64_t rows, int64_t width, TokenInputs tokens, LossParams params,
                              float* log_prob, int64_t log_prob_stride, float* entropy, int64_t entropy_stride,
                              float* squares, int64_t squares_stride, LseTokens lse, LseTokens mean_logit,
                              const DeviceError* error) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  TokenPolicy t = token_policy(merged + i * width, tokens.target(i), params, width == kStatsWidthWithSquares);
  if (error->code != 0) t = TokenPolicy{NAN, NAN, NAN, NAN, NAN};
  if (log_prob != nullptr) log_prob[i * log_prob_stride] = static_cast<float>(t.log_prob);
  if (entropy != nullptr) entropy[i * entropy_stride] = static_cast<float>(t.entropy);
  if (squares != nullptr) squares[i * squares_stride] = static_cast<float>(t.sum_p_squared);
  if (lse.base != nullptr) lse.set(i, t.lse);
  if (mean_logit.base != nullptr) mean_logit.set(i, t.mean_logit);
}

// One block: the reduced loss from the per-token terms, in a fixed order.
__global__ void __launch_bounds__(kThreads)
    reduce_loss_kernel(const double* terms, int64_t rows, TokenInputs tokens, LossParams params, float* loss,
                       const DeviceError* error) {
  double mine = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) mine += terms[i];
  const double total = block_sum(mine);
  __syncthreads();
  double denominator = 1.0;
  if (params.reduction == Reduction::kMean) {
    denominator = counted_weight(tokens, rows, params);
  }
  if (threadIdx.x == 0) {
    loss[0] = error->code != 0 ? NAN
              : params.reduction == Reduction::kMean
                  ? static_cast<float>(denominator != 0.0 ? total / denominator : 0.0)
                  : static_cast<float>(total);
  }
}

// One block: the upstream gradient shared by every token of a reduced loss, from grad_loss
// (device memory) or, when it is null, `value`.
__global__ void __launch_bounds__(kThreads)
    shared_upstream_kernel(const float* grad_loss, float value, TokenInputs tokens, int64_t rows, LossParams params,
                           double* out) {
  double denominator = 1.0;
  if (params.reduction == Reduction::kMean) denominator = counted_weight(tokens, rows, params);
  if (threadIdx.x == 0) {
    const double g = static_cast<double>(grad_loss != nullptr ? grad_loss[0] : value);
    *out = params.reduction == Reduction::kMean ? (denominator != 0.0 ? g / denominator : 0.0) : g;
  }
}

// f(first, x, y) over runs of in[0, cols): x the run widened, y what to store at
// out[first, first + kN) as TOut. Runs are 16-byte vectors of `in` where `in` and `out` are
// aligned for them (thread t taking vectors t and t + kThreads, both loaded before either is
// stored, then t + 2 kThreads...), else single elements. Each element is read and written by
// the same thread, so out may be in.
template <class TIn, class TOut, class F>
__device__ __forceinline__ void map_row(const TIn* in, TOut* out, int64_t cols, F&& f) {
  constexpr int kVector = 16 / sizeof(TIn);
  constexpr int kOutAlign = kVector * sizeof(TOut) < 16 ? kVector * sizeof(TOut) : 16;
  const auto in_address = reinterpret_cast<uintptr_t>(in);
  int64_t head = static_cast<int64_t>(((16 - in_address % 16) % 16) / sizeof(TIn));
  const bool aligned =
      in_address % sizeof(TIn) == 0 && (reinterpret_cast<uintptr_t>(out) + head * sizeof(TOut)) % kOutAlign == 0;
  if (!aligned) head = cols;
  head = head < cols ? head : cols;
  auto single = [&](int64_t v) {
    const float x[1] = {to_float(in[v])};
    float y[1];
    f(v, x, y);
    store_run(out + v, y);
  };
  for (int64_t v = threadIdx.x; v < head; v += kThreads) single(v);
  const int64_t vectors = (cols - head) / kVector;
  const auto* body = reinterpret_cast<const uint4*>(in + head);
  for (int64_t k = threadIdx.x; k < vectors; k += 2 * kThreads) {
    const bool second = k + kThreads < vectors;
    const uint4 a = body[k];
    const uint4 b = second ? body[k + kThreads] : a;
    float x[kVector], y[kVector];
    widen<TIn>(a, x);
    f(head + k * kVector, x, y);
    store_run(out + head + k * kVector, y);
    if (second) {
      widen<TIn>(b, x);
      f(head + (k + kThreads) * kVector, x, y);
      store_run(out + head + (k + kThreads) * kVector, y);
    }
  }
  for (int64_t v = head + vectors * kVector + threadIdx.x; v < cols; v += kThreads) single(v);
}

// logits [rows, cols] (TIn) -> grad [rows, cols] (TOut), which may be the logits:
//   grad_v = upstream (exp(z_v - lse) coefficient - uniform - (1 - s) [v = target]) dz/dx_v
// and 0 on padding columns and on tokens that do not count (written without reading the
// logits). kPlain: no transform (PlainGradient's exp on the special-function unit).
template <class TIn, class TOut, bool kPlain>
__global__ void __launch_bounds__(kThreads) gradient_kernel(const TIn* logits, int64_t ld, TOut* grad, int64_t grad_ld,
                                                            int64_t cols, int64_t valid, GradientParams p) {
  const int64_t i = blockIdx.x;
  const int64_t y = p.tokens.target(i);
  const GradientConstants c = p.constants(i, y);
  const Transform t = transform_of(p.params, i);
  const float target_term = target_weight(p.params);
  const int64_t target_column = y - p.vocab_begin;
  TOut* out = grad + i * grad_ld;
  if (c.zero_row()) {  // a token that does not count
    for (int64_t v = threadIdx.x; v < cols; v += kThreads) out[v] = from_float<TOut>(0.0f);
    return;
  }
  if constexpr (kPlain) {
    const PlainGradient k = PlainGradient::of(c, target_term);
    map_row(logits + i * ld, out, cols,
            [&](int64_t first, const auto& x, auto& g) { k.run(first, x, g, target_column, valid); });
  } else {
    map_row(logits + i * ld, out, cols, [&](int64_t first, const auto& x, auto& g) {
      constexpr int n = static_cast<int>(std::extent_v<std::remove_reference_t<decltype(x)>>);
#pragma unroll
      for (int j = 0; j < n; ++j) {
        const int64_t v = first + j;
        if (v >= valid) {  // padding
          g[j] = 0.0f;
          continue;
        }
        g[j] = gradient_element(c, t, x[j], v == target_column, target_term);
      }
    });
  }
}

// One thread per rank: the gathered headers describe one call (the same check as the
// host's check_group, which device_status() runs on the same bytes for the message).
__global__ void check_group_kernel(const char* gathered, int64_t stride, int ranks, DeviceError* error) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= ranks) return;
  const auto* first = reinterpret_cast<const RankHeader*>(gathered);
  const auto* h = reinterpret_cast<const RankHeader*>(gathered + r * stride);
  bool ok = h->magic == RankHeader::kMagic && h->version == RankHeader::kVersion && h->rank == r &&
            h->num_ranks == ranks && h->status == 0 && h->num_tokens == first->num_tokens &&
            h->vocab_size == first->vocab_size && h->logits_dtype == first->logits_dtype &&
            h->label_smoothing_bits == first->label_smoothing_bits &&
            h->smoothing_semantics == first->smoothing_semantics && h->ignore_index == first->ignore_index &&
            h->z_loss_bits == first->z_loss_bits && h->logit_scale_bits == first->logit_scale_bits &&
            h->softcap_bits == first->softcap_bits && h->valid_vocab_size == first->valid_vocab_size &&
            h->reduction == first->reduction && h->has_weights == first->has_weights &&
            h->stats_width == first->stats_width && h->inputs_hash == first->inputs_hash;
  // The operation's block, byte for byte (its name, mode, values and labels).
  const auto* mine = reinterpret_cast<const unsigned char*>(&h->operation);
  const auto* theirs = reinterpret_cast<const unsigned char*>(&first->operation);
  for (std::size_t k = 0; ok && k < sizeof(OperationBlock); ++k) ok = mine[k] == theirs[k];
  // Ranges: each non-empty one inside [0, V), overlapping no other; together they cover V.
  const int64_t begin = h->vocab_begin;
  const int64_t end = h->vocab_end;
  if (ok && end > begin) {
    ok = begin >= 0 && end <= h->vocab_size;
    for (int other = 0; other < ranks && ok; ++other) {
      const auto* o = reinterpret_cast<const RankHeader*>(gathered + other * stride);
      if (other != r && o->vocab_end > o->vocab_begin) ok = o->vocab_end <= begin || end <= o->vocab_begin;
    }
  }
  if (ok && r == 0) {
    int64_t covered = 0;
    for (int other = 0; other < ranks; ++other) {
      const auto* o = reinterpret_cast<const RankHeader*>(gathered + other * stride);
      if (o->vocab_end > o->vocab_begin) covered += o->vocab_end - o->vocab_begin;
    }
    ok = covered == first->vocab_size;
  }
  if (!ok) atomicCAS(&error->code, 0, kGroupCheckFailed);
}

// Writes this rank's header into its send buffer (a kernel argument: no host memory is read
// at run time, so the launch can be captured in a CUDA graph).
__global__ void write_header_kernel(RankHeader header, RankHeader* out) {
  if (threadIdx.x == 0) *out = header;
}

}  // namespace

Status local_stats(const RowMatrix& logits, const TokenVector& targets, const TokenVector& weights, int64_t vocab_begin,
                   const LossParams& params, const RowMatrix& stats, RankHeader* header, cudaStream_t stream) {
  if (logits.rows == 0) return {};
  const int64_t valid = valid_columns(vocab_begin, logits.cols, params);
  const bool plain = is_plain(params) && stats.row_stride != 6;  // no extras (the kernel's width)
  with_type(logits.dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    auto* kernel = plain ? local_stats_kernel<T, true> : local_stats_kernel<T, false>;
    kernel<<<static_cast<unsigned>(logits.rows), kThreads, 0, stream>>>(
        reinterpret_cast<const T*>(logits.base), logits.row_stride, logits.cols, valid, token_inputs(targets, weights),
        vocab_begin, params, reinterpret_cast<float*>(stats.base), stats.row_stride, header);
  });
  return launched("local statistics");
}

Status merge_and_loss(const float* gathered, int64_t rank_stride, int ranks, int64_t rows, int64_t width, float* merged,
                      const TokenVector& targets, const TokenVector& weights, const LossParams& params,
                      const LossOutputs& out, double* terms, const DeviceError* error, cudaStream_t stream) {
  const TokenInputs tokens = token_inputs(targets, weights);
  if (rows == 0) {  // nothing to merge; a reduction of no tokens is 0, as on the CPU
    if (params.reduction == Reduction::kNone) return {};
    reduce_loss_kernel<<<1, kThreads, 0, stream>>>(terms, 0, tokens, params, reinterpret_cast<float*>(out.loss.base),
                                                   error);
    return launched("reduction");
  }
  constexpr int kTokens = 256;
  merge_kernel<<<grid_for(rows, kTokens), kTokens, 0, stream>>>(gathered, rank_stride, ranks, rows, width, params,
                                                                merged);
  if (Status s = launched("merge"); !s.ok()) return s;
  loss_kernel<<<grid_for(rows, kTokens), kTokens, 0, stream>>>(
      merged, rows, width, tokens, params, reinterpret_cast<float*>(out.loss.base), out.loss.stride, terms,
      lse_tokens(out.lse), reinterpret_cast<float*>(out.target_is_argmax.base), out.target_is_argmax.stride,
      reinterpret_cast<float*>(out.entropy.base), out.entropy.stride, error);
  if (Status s = launched("loss"); !s.ok()) return s;
  if (params.reduction == Reduction::kNone) return {};
  reduce_loss_kernel<<<1, kThreads, 0, stream>>>(terms, rows, tokens, params, reinterpret_cast<float*>(out.loss.base),
                                                 error);
  return launched("reduction");
}

Status merge_and_policy(const float* gathered, int64_t rank_stride, int ranks, int64_t rows, int64_t width,
                        float* merged, const TokenVector& targets, const LossParams& params,
                        const PolicyForwardOutputs& out, const DeviceError* error, cudaStream_t stream) {
  if (rows == 0) return {};
  constexpr int kTokens = 256;
  merge_kernel<<<grid_for(rows, kTokens), kTokens, 0, stream>>>(gathered, rank_stride, ranks, rows, width, params,
                                                                merged);
  if (Status s = launched("merge"); !s.ok()) return s;
  policy_kernel<<<grid_for(rows, kTokens), kTokens, 0, stream>>>(
      merged, rows, width, token_inputs(targets, TokenVector{}), params, reinterpret_cast<float*>(out.log_prob.base),
      out.log_prob.stride, reinterpret_cast<float*>(out.entropy.base), out.entropy.stride,
      reinterpret_cast<float*>(out.sum_p_squared.base), out.sum_p_squared.stride, lse_tokens(out.lse),
      lse_tokens(out.mean_logit), error);
  return launched("RL outputs");
}

Status reduce_loss(const double* terms, int64_t rows, const TokenVector& targets, const TokenVector& weights,
                   const LossParams& params, float* loss, const DeviceError* error, cudaStream_t stream) {
  reduce_loss_kernel<<<1, kThreads, 0, stream>>>(terms, rows, token_inputs(targets, weights), params, loss, error);
  return launched("reduction");
}

Status shared_upstream(const float* grad_loss, float value, const TokenVector& targets, const TokenVector& weights,
                       int64_t rows, const LossParams& params, double* out, cudaStream_t stream) {
  shared_upstream_kernel<<<1, kThreads, 0, stream>>>(grad_loss, value, token_inputs(targets, weights), rows, params,
                                                     out);
  return launched("upstream gradient");
}

Status gradient(const RowMatrix& logits, const TokenVector& targets, const TokenVector& weights, const TokenVector& lse,
                const TokenVector& grad_loss, int64_t vocab_begin, const LossParams& params, const RowMatrix& grad,
                double* shared_upstream, cudaStream_t stream, const PolicyBackwardInputs* policy) {
  if (logits.rows == 0) return {};
  double* shared = nullptr;
  if (params.reduction != Reduction::kNone) {
    if (Status s = cuda::shared_upstream(reinterpret_cast<const float*>(grad_loss.base), 0.0f, targets, weights,
                                         logits.rows, params, shared_upstream, stream);
        !s.ok()) {
      return s;
    }
    shared = shared_upstream;
  }
  const int64_t valid = valid_columns(vocab_begin, logits.cols, params);
  const GradientParams p = policy != nullptr
                               ? policy_gradient_params(targets, lse, policy->grad_log_prob, policy->grad_entropy,
                                                        policy->mean_logit, vocab_begin, params)
                               : gradient_params(targets, weights, lse, grad_loss, shared, vocab_begin, params);
  with_type(logits.dtype, [&](auto* in_type) {
    using TIn = std::remove_pointer_t<decltype(in_type)>;
    with_type(grad.dtype, [&](auto* out_type) {
      using TOut = std::remove_pointer_t<decltype(out_type)>;
      auto* kernel = is_plain(params) ? gradient_kernel<TIn, TOut, true> : gradient_kernel<TIn, TOut, false>;
      kernel<<<static_cast<unsigned>(logits.rows), kThreads, 0, stream>>>(
          reinterpret_cast<const TIn*>(logits.base), logits.row_stride, reinterpret_cast<TOut*>(grad.base),
          grad.row_stride, logits.cols, valid, p);
    });
  });
  return launched("gradient");
}

Status write_header(const RankHeader& header, RankHeader* out, cudaStream_t stream) {
  write_header_kernel<<<1, 32, 0, stream>>>(header, out);
  return launched("header");
}

Status check_group(const char* gathered, int64_t stride, int ranks, DeviceError* error, cudaStream_t stream) {
  check_group_kernel<<<grid_for(ranks, 128), 128, 0, stream>>>(gathered, stride, ranks, error);
  return launched("group check");
}

}  // namespace vpce::detail::cuda
