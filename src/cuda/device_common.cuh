// cuda/device_common.cuh: the device arithmetic the CUDA loss kernels (cuda/kernels.cu)
// and the fused head's epilogue kernels (head/cuda/head_kernels.cu) share: dtype
// conversions, the logit transform, a thread's and a block's online statistics (Part) with
// their combine (a part is empty only if its max is -inf and its sum is not NaN: NaN reaches
// the loss), the fixed shuffle trees (deterministic), the targets' reader, and the launches' host-side
// helpers. Every block
// has kThreads threads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "../common/token_math.h"
#include "../protocol.h"
#include "../validate.h"
#include "vpce/status.h"

namespace vpce::detail::cuda_common {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// A row's logit transform (token_math.h's RowTransform: the temperature rides in it).
struct Transform {
  float scale;
  float cap;
  float inverse_cap;
  float slope_scale;
  __device__ __forceinline__ float apply(float x) const {
    const float z = x * scale;
    return cap > 0.0f ? cap * tanhf(z * inverse_cap) : z;
  }
  // dz/dx at the logit x: soft-capped, slope_scale (1 - tanh^2 a) with a = scale x / cap, as
  // 4 e / (1 + e)^2, e = exp(-2 |a|) (1 - u^2 from the rounded u = tanh a cancels where tanh
  // saturates; the CPU's SoftCap takes the same value from expm1, as 4 (y + 1) / (y + 2)^2).
  __device__ __forceinline__ float slope(float x) const {
    if (cap <= 0.0f) return scale;
    const float a = (x * scale) * inverse_cap;
    const float e = expf(-2.0f * fabsf(a));
    const float one_plus = 1.0f + e;
    return (4.0f * slope_scale) * (e / (one_plus * one_plus));
  }
};

// Row `row`'s transform. On the host only without per-token temperatures (they are device
// memory): the kernels take it per row.
__host__ __device__ inline Transform transform_of(const LossParams& p, int64_t row = 0) {
  const RowTransform r = row_transform(p, row);
  return {r.scale, r.cap, r.inverse_cap, r.slope_scale};
}

// Rows that take the plain paths: no transform or temperature, no label smoothing, no
// entropy term (with the extras checked by the caller).
inline bool is_plain(const LossParams& p) {
  return p.logit_scale == 1.0f && p.softcap <= 0.0f && !p.with_sum_logits() && p.without_temperature() &&
         !p.entropy_gradient;
}

// One thread's online statistics, then the block's, relative to their own max. (No member
// initialisers: an array of them lives in shared memory; empty_part() makes an empty one.)
struct Part {
  float max;
  double sum_exp;
  double sum_logits;
  double weighted;  // sum exp(z - max)(z - max)
  double squares;   // sum exp(2 (z - max)) (with the extras)
  int32_t argmax;   // smallest column holding max
};

__device__ __forceinline__ Part empty_part() { return Part{-INFINITY, 0.0, 0.0, 0.0, 0.0, -1}; }

// No mass: every element -inf. (A NaN element leaves max at -inf but sum_exp NaN: that
// part is not empty, and its NaN must reach the loss.)
__device__ __forceinline__ bool empty(const Part& p) { return p.max == -INFINITY && !isnan(p.sum_exp); }

__device__ __forceinline__ void combine(Part& a, const Part& b) {
  if (empty(b)) {
    a.sum_logits += b.sum_logits;
    return;
  }
  if (empty(a)) {
    const double sum_logits = a.sum_logits;
    a = b;
    a.sum_logits += sum_logits;
    return;
  }
  const float max = a.max > b.max ? a.max : b.max;
  const double shift_a = static_cast<double>(a.max) - max;
  const double shift_b = static_cast<double>(b.max) - max;
  const double scale_a = exp(shift_a);
  const double scale_b = exp(shift_b);
  a.weighted = scale_a * (a.weighted + shift_a * a.sum_exp) + scale_b * (b.weighted + shift_b * b.sum_exp);
  a.squares = scale_a * scale_a * a.squares + scale_b * scale_b * b.squares;
  a.sum_exp = a.sum_exp * scale_a + b.sum_exp * scale_b;
  a.sum_logits += b.sum_logits;
  int32_t argmax = a.max == max ? a.argmax : -1;
  if (b.max == max && (argmax < 0 || b.argmax < argmax)) argmax = b.argmax;
  a.argmax = argmax;
  a.max = max;
}

// One element of the gradient on the general path (any transform), the loss's rows, the RL
// outputs' and the head's tiles alike: x the logit (the head's with its bias), is_target
// whether its column is the target's, target_term (1 - s) (token_math.h's target_weight):
//   [upstream (p coefficient - uniform - [target] target_term) + entropy p (z - E_p[z])] dz/dx
// with p = e^(z - lse32) (the entropy's term, token_math.h's, only where it is not 0).
__device__ __forceinline__ float gradient_element(const GradientConstants& c, const Transform& t, float x,
                                                  bool is_target, float target_term) {
  const float z = t.apply(x);
  const float p = expf(z - c.lse);
  float e = p * c.coefficient - c.uniform;
  if (is_target) e -= target_term;
  float g = e * c.upstream;
  if (c.entropy != 0.0f) g += c.entropy * p * entropy_offset(z, c);
  return g * t.slope(x);
}

// The online-softmax fold of one transformed logit z, at global column v, into a thread's
// Part (the loss's rows and the head's tiles alike): the sum of z when asked (label
// smoothing), then, for a finite z, a new max rescales the sums in fp64, or e^(z - max) adds
// to them (with the extras, e^(z - max) (z - max) to the weighted sum); the argmax keeps the
// smallest column holding the max.
__device__ __forceinline__ void fold_element(Part& p, float z, int32_t v, bool sum_logits, bool extras) {
  if (sum_logits) p.sum_logits += z;
  if (z == -INFINITY) return;
  if (z > p.max) {
    if (p.max == -INFINITY) {  // sum_exp is 0, or NaN from an earlier NaN, which stays
      p.sum_exp += 1.0;
    } else {
      const double shift = static_cast<double>(p.max) - z;
      const double scale = exp(shift);
      p.weighted = scale * (p.weighted + shift * p.sum_exp);
      p.squares = p.squares * scale * scale + 1.0;
      p.sum_exp = p.sum_exp * scale + 1.0;
    }
    p.max = z;
    p.argmax = v;
  } else {
    const float offset = z - p.max;
    const float e = expf(offset);
    p.sum_exp += e;
    if (extras) {
      p.weighted += static_cast<double>(e) * offset;
      p.squares += static_cast<double>(e) * e;
    }
    if (z == p.max && v < p.argmax) p.argmax = v;
  }
}

__device__ inline Part shuffle_down(const Part& p, int offset) {
  Part q = empty_part();
  q.max = __shfl_down_sync(0xffffffffu, p.max, offset);
  q.sum_exp = __shfl_down_sync(0xffffffffu, p.sum_exp, offset);
  q.sum_logits = __shfl_down_sync(0xffffffffu, p.sum_logits, offset);
  q.weighted = __shfl_down_sync(0xffffffffu, p.weighted, offset);
  q.squares = __shfl_down_sync(0xffffffffu, p.squares, offset);
  q.argmax = __shfl_down_sync(0xffffffffu, p.argmax, offset);
  return q;
}

// The block's combined Part, valid in thread 0. Fixed tree: deterministic.
__device__ inline Part block_combine(Part p) {
  __shared__ Part warps[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) {
    const Part other = shuffle_down(p, offset);
    combine(p, other);
  }
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = p;
  __syncthreads();
  if (warp == 0) {
    p = lane < kWarps ? warps[lane] : empty_part();
    for (int offset = kWarps / 2; offset > 0; offset /= 2) {
      const Part other = shuffle_down(p, offset);
      combine(p, other);
    }
  }
  return p;
}

// ---- the plain rows: no transform, no label smoothing, no extras ----------------------------
// The loss's and the head's kernels take these where a row needs only (max, sum of exp) and
// the gradient's exponential: two 16-byte vectors in flight per thread, one max test per pair
// of vectors, exp on the special-function unit, the pair's exponentials summed in fp32 then
// into the fp64 sum.

inline constexpr float kLog2e = 1.44269504088896341f;

// 2^x on the special-function unit (ex2.approx.ftz: within 2 ulps; results below 2^-126 are 0).
__device__ __forceinline__ float exp2_sfu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Folds kN values into p's max and sum of exp(z - max). -inf adds 0; NaN makes the sum NaN
// (it reaches the loss) and leaves the max.
template <int kN>
__device__ __forceinline__ void fold_plain(const float (&z)[kN], Part& p) {
  float m = z[0];
#pragma unroll
  for (int j = 1; j < kN; ++j) m = fmaxf(m, z[j]);
  if (m > p.max) {
    if (p.max != -INFINITY) p.sum_exp *= exp(static_cast<double>(p.max) - m);
    p.max = m;
  }
  const float reference = p.max == -INFINITY ? 0.0f : p.max;
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kN; ++j) sum += exp2_sfu((z[j] - reference) * kLog2e);
  p.sum_exp += sum;
}

// 16 bytes of T as floats.
template <class T>
__device__ __forceinline__ void widen(const uint4& bits, float* z) {
  const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) z[j] = __uint_as_float(w[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        z[2 * j] = __uint_as_float(w[j] << 16);
        z[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
      } else {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
        z[2 * j] = f.x;
        z[2 * j + 1] = f.y;
      }
    }
  }
}

// Stores n values of TOut from `values` at `out`, as one or two 16-byte (or one 8-byte) store.
template <class TOut, int kCount>
__device__ __forceinline__ void store_vector(TOut* out, const TOut (&values)[kCount]) {
  constexpr int kBytes = kCount * sizeof(TOut);
  if constexpr (kBytes == 32) {
    reinterpret_cast<uint4*>(out)[0] = reinterpret_cast<const uint4*>(values)[0];
    reinterpret_cast<uint4*>(out)[1] = reinterpret_cast<const uint4*>(values)[1];
  } else if constexpr (kBytes == 16) {
    *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(values);
  } else {
    static_assert(kBytes == 8);
    *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(values);
  }
}

// kN floats stored at `out` as TOut: pairs rounded together (one conversion each), one or
// two 16-byte (or one 8-byte) stores for a vector.
template <class TOut, int kN>
__device__ __forceinline__ void store_run(TOut* out, const float (&y)[kN]) {
  if constexpr (kN == 1) {
    *out = from_float<TOut>(y[0]);
  } else {
    alignas(16) TOut values[kN];
#pragma unroll
    for (int j = 0; j < kN; j += 2) {
      if constexpr (std::is_same_v<TOut, __nv_bfloat16>) {
        *reinterpret_cast<__nv_bfloat162*>(&values[j]) = __floats2bfloat162_rn(y[j], y[j + 1]);
      } else if constexpr (std::is_same_v<TOut, __half>) {
        *reinterpret_cast<__half2*>(&values[j]) = __floats2half2_rn(y[j], y[j + 1]);
      } else {
        values[j] = y[j];
        values[j + 1] = y[j + 1];
      }
    }
    store_vector(out, values);
  }
}

// 16 bytes of T, every element -inf.
template <class T>
__device__ __forceinline__ uint4 minus_infinity_bits() {
  const uint32_t w = sizeof(T) == 4 ? 0xff800000u : std::is_same_v<T, __nv_bfloat16> ? 0xff80ff80u : 0xfc00fc00u;
  return uint4{w, w, w, w};
}

// Thread t's Part of row[0, cols) (max and sum of exp only): vectors t and t + kThreads, then
// t + 2 kThreads..., both loads issued before the arithmetic; the elements before the first
// 16-byte boundary and after the last vector one at a time. Every block thread calls it.
template <class T>
__device__ __forceinline__ Part fold_row_plain(const T* row, int64_t cols) {
  constexpr int kVector = 16 / sizeof(T);
  Part p = empty_part();
  const auto address = reinterpret_cast<uintptr_t>(row);
  int64_t head = static_cast<int64_t>(((16 - address % 16) % 16) / sizeof(T));
  if (address % sizeof(T) != 0) head = cols;  // misaligned elements: all scalar
  head = head < cols ? head : cols;
  for (int64_t v = threadIdx.x; v < head; v += kThreads) {
    const float z[1] = {to_float(row[v])};
    fold_plain(z, p);
  }
  const int64_t vectors = (cols - head) / kVector;
  const auto* body = reinterpret_cast<const uint4*>(row + head);
  for (int64_t k = threadIdx.x; k < vectors; k += 2 * kThreads) {
    const uint4 a = body[k];
    const uint4 b = k + kThreads < vectors ? body[k + kThreads] : minus_infinity_bits<T>();
    float z[2 * kVector];
    widen<T>(a, z);
    widen<T>(b, z + kVector);
    fold_plain(z, p);
  }
  for (int64_t v = head + vectors * kVector + threadIdx.x; v < cols; v += kThreads) {
    const float z[1] = {to_float(row[v])};
    fold_plain(z, p);
  }
  return p;
}

// A plain row's gradient, grad_v = scale e^(z_v - lse) - uniform [- target at the target
// column] (0 on padding), from token_math.h's constants: lse32 and the upstream g w times
// the coefficient (z-loss factor and e^(lse32 - lse)), the smoothing's uniform part and the
// target's weight, each rounded once from fp64.
struct PlainGradient {
  float lse;
  float scale;
  float uniform;
  float target;
  __device__ static PlainGradient of(const GradientConstants& c, float target_term) {
    return {c.lse, static_cast<float>(c.exact_upstream * static_cast<double>(c.coefficient)),
            static_cast<float>(c.exact_upstream * c.exact_uniform),
            static_cast<float>(c.exact_upstream * static_cast<double>(target_term))};
  }
  __device__ __forceinline__ float at(float z) const { return fmaf(exp2_sfu((z - lse) * kLog2e), scale, -uniform); }
  // g[j] for the kN columns from `first`: the target's and the padding's corrections are a
  // range test per run.
  template <int kN>
  __device__ __forceinline__ void run(int64_t first, const float (&z)[kN], float (&g)[kN], int64_t target_column,
                                      int64_t valid) const {
#pragma unroll
    for (int j = 0; j < kN; ++j) g[j] = at(z[j]);
    if (target_column >= first && target_column < first + kN) {
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        if (first + j == target_column) g[j] -= target;
      }
    }
    if (first + kN > valid) {
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        if (first + j >= valid) g[j] = 0.0f;
      }
    }
  }
};

__device__ __forceinline__ int64_t target_of(const void* targets, bool wide, int64_t stride, int64_t i) {
  return wide ? static_cast<const int64_t*>(targets)[i * stride] : static_cast<const int32_t*>(targets)[i * stride];
}

// The block's sum of `value`, valid in thread 0. Fixed tree: deterministic.
__device__ inline double block_sum(double value) {
  __shared__ double warps[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = value;
  __syncthreads();
  value = threadIdx.x < kWarps ? warps[threadIdx.x] : 0.0;
  if (threadIdx.x < 32) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  return value;
}

// The tokens' targets (int32 or int64) and optional weights (null: ones), as every kernel
// takes them: one argument rather than five.
struct TokenInputs {
  const void* targets;
  bool wide;  // int64 targets
  int64_t target_stride;
  const float* weights;
  int64_t weight_stride;
  __device__ __forceinline__ int64_t target(int64_t i) const { return target_of(targets, wide, target_stride, i); }
  __device__ __forceinline__ float weight(int64_t i) const {
    return weights != nullptr ? weights[i * weight_stride] : 1.0f;
  }
  // A target outside [0, Vv) that is not ignore_index, or a weight that is negative or not
  // finite: sets header->status (its message is ready), when there is a header.
  // Token i's target, weight and (the RL outputs') per-token temperature, checked: a bad one
  // sets header->status.
  __device__ __forceinline__ void flag_bad(int64_t i, int64_t y, const LossParams& params, RankHeader* header) const {
    const bool bad_target = !params.ignored(y) && (y < 0 || y >= params.valid_vocab);
    const bool bad_weight =
        weights != nullptr && !(isfinite(weights[i * weight_stride]) && weights[i * weight_stride] >= 0.0f);
    const float temperature = params.temperature_of(i);
    const bool bad_temperature =
        params.temperatures != nullptr && !usable_temperature(params.logit_scale, params.softcap, temperature);
    if ((bad_target || bad_weight || bad_temperature) && header != nullptr) {
      atomicCAS(&header->status, 0, static_cast<int32_t>(Code::kInvalidArgument));
    }
  }
};

inline TokenInputs token_inputs(const TokenVector& targets, const TokenVector& weights) {
  return {targets.base, targets.dtype == kInt64, targets.stride, reinterpret_cast<const float*>(weights.base),
          weights.stride};
}

// The counted weight of every token (for kMean), summed in a fixed tree by one block.
__device__ inline double counted_weight(const TokenInputs& tokens, int64_t rows, const LossParams& params) {
  double mine = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
    if (!params.ignored(tokens.target(i))) mine += static_cast<double>(tokens.weight(i));
  }
  return block_sum(mine);
}

// What the gradient of token i needs beyond its logits, for the loss's, the RL outputs' and
// the head's gradient kernels alike: the tokens, the lse, the upstream gradient (per token, or
// the one a reduced loss shares), this rank's first column, the parameters (each row's
// transform from them: transform_of(params, i)); for the RL outputs (policy), grad_loss is
// grad_log_prob, with grad_entropy and E_p[z] (either upstream null: 0).
struct GradientParams {
  TokenInputs tokens;
  LseTokens lse;
  const float* grad_loss;
  int64_t grad_loss_stride;
  const double* shared_upstream;  // null: per token
  int64_t vocab_begin;
  LossParams params;
  bool policy = false;
  const float* grad_entropy = nullptr;
  int64_t grad_entropy_stride = 0;
  LseTokens mean_logit{};
  // Token i's gradient constants, y its target.
  __device__ __forceinline__ GradientConstants constants(int64_t i, int64_t y) const {
    if (policy) {
      const double g_lp = grad_loss != nullptr ? static_cast<double>(grad_loss[i * grad_loss_stride]) : 0.0;
      const double g_h = grad_entropy != nullptr ? static_cast<double>(grad_entropy[i * grad_entropy_stride]) : 0.0;
      return policy_gradient_constants(y, g_lp, g_h, lse.get(i), grad_entropy != nullptr ? mean_logit.get(i) : 0.0,
                                       params);
    }
    const double upstream =
        shared_upstream != nullptr ? *shared_upstream : static_cast<double>(grad_loss[i * grad_loss_stride]);
    return gradient_constants(y, upstream, tokens.weight(i), lse.get(i), params);
  }
};

// The RL outputs' gradient parameters: grad_log_prob in grad_loss's place, grad_entropy and
// E_p[z] (an upstream gradient not given: 0).
inline GradientParams policy_gradient_params(const TokenVector& targets, const TokenVector& lse,
                                             const TokenVector& grad_log_prob, const TokenVector& grad_entropy,
                                             const TokenVector& mean_logit, int64_t vocab_begin,
                                             const LossParams& params) {
  GradientParams p{token_inputs(targets, TokenVector{}),
                   lse_tokens(lse),
                   reinterpret_cast<const float*>(grad_log_prob.base),
                   grad_log_prob.stride,
                   nullptr,
                   vocab_begin,
                   params};
  p.policy = true;
  p.grad_entropy = reinterpret_cast<const float*>(grad_entropy.base);
  p.grad_entropy_stride = grad_entropy.stride;
  p.mean_logit = lse_tokens(mean_logit);
  return p;
}

// The gradient's parameters from the validated arguments (shared_upstream null: per token).
inline GradientParams gradient_params(const TokenVector& targets, const TokenVector& weights, const TokenVector& lse,
                                      const TokenVector& grad_loss, const double* shared_upstream, int64_t vocab_begin,
                                      const LossParams& params) {
  return {token_inputs(targets, weights),
          lse_tokens(lse),
          reinterpret_cast<const float*>(grad_loss.base),
          grad_loss.stride,
          shared_upstream,
          vocab_begin,
          params};
}

// ---- host side of the launches ----

// kSystemError naming `what` if the last launch failed.
inline Status launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return {};
  return {Code::kSystemError, std::string("cuda: ") + what + ": " + cudaGetErrorString(e)};
}

// f(T*) with T the element type of `dtype` (float, __nv_bfloat16 or __half; the pointer null).
template <class F>
void with_type(DataType dtype, F&& f) {
  if (dtype == kFloat32) {
    f(static_cast<float*>(nullptr));
  } else if (dtype == kBFloat16) {
    f(static_cast<__nv_bfloat16*>(nullptr));
  } else {
    f(static_cast<__half*>(nullptr));
  }
}

// Blocks of `threads` covering n.
inline unsigned grid_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace vpce::detail::cuda_common
