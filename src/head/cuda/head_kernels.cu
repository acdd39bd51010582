// head/cuda/head_kernels.cu: the fused head's CUDA epilogue kernels (see head_kernels.h).
//
// The per-element arithmetic is src/cuda/kernels.cu's, for an fp32 tile with a bias: the
// transform, the parts, their combine and the fixed trees from cuda/device_common.cuh, the
// same online fold of a thread's elements (fp32 max and exp, fp64 sums, -inf skipped, NaN
// kept) and the same gradient formula on token_math.h's constants. One block of kThreads per tile row; deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "../../cuda/device_common.cuh"
#include "head_kernels.h"

namespace vpce::detail::head_cuda {
namespace {

using namespace cuda_common;  // NOLINT: the shared device arithmetic, unqualified

// The logit at the tile's column c from the GEMM's value there: plus the bias (as the
// operands' dtype stores it), and with round_logits rounded as a bf16 or fp16 layer rounds
// it, the product and then its sum with the bias (tiles.cc's finish_logits on the CPU).
struct TileLogits {
  const void* bias;
  int64_t stride;
  int kind;      // the bias: 0 none, 1 fp32, 2 bf16, 3 fp16
  int rounding;  // 0 none, 2 bf16, 3 fp16
  __device__ __forceinline__ float bias_at(int64_t c) const {
    switch (kind) {
      case 1: return static_cast<const float*>(bias)[c * stride];
      case 2: return __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[c * stride]);
      case 3: return __half2float(static_cast<const __half*>(bias)[c * stride]);
      default: return 0.0f;
    }
  }
  __device__ __forceinline__ float round(float x) const {
    switch (rounding) {
      case 2: return __bfloat162float(__float2bfloat16_rn(x));
      case 3: return __half2float(__float2half_rn(x));
      default: return x;
    }
  }
  __device__ __forceinline__ float at(float product, int64_t c) const {
    return rounding == 0 ? product + bias_at(c) : round(round(product) + bias_at(c));
  }
};

int dtype_kind(DataType d) { return d == kFloat32 ? 1 : d == kBFloat16 ? 2 : 3; }

// The tile's bias, pointing at its first column, and its rounding.
TileLogits tile_logits(const TileColumns& c) {
  const int rounding = c.rounding == kFloat32 ? 0 : dtype_kind(c.rounding);
  if (c.bias == nullptr) return TileLogits{nullptr, 0, 0, rounding};
  const auto* first = static_cast<const char*>(c.bias) + c.col0 * c.bias_stride * c.dtype.bytes();
  return TileLogits{first, c.bias_stride, dtype_kind(c.dtype), rounding};
}

__global__ void init_running_kernel(RunningStats* running, int64_t rows) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  running[i] = RunningStats{-INFINITY, -1, 0.0, 0.0, 0.0, -INFINITY, 0};
}

// One block per tile row: the row's Part over the tile's valid columns (as
// cuda/kernels.cu's local_stats_kernel folds a row), then running[r] <- running[r] then it.
__global__ void __launch_bounds__(kThreads)
    fold_tile_kernel(const float* z, int64_t ld, int64_t valid, int64_t col0, TileLogits logits, TokenInputs tokens,
                     int64_t vocab_begin, LossParams params, bool extras, bool plain, RunningStats* running) {
  const int64_t r = blockIdx.x;
  const Transform t = transform_of(params, r);  // (per-token temperatures start at the tile's first token)
  const float* row = z + r * ld;
  const bool sum_logits = params.with_sum_logits();
  Part p = empty_part();
  if (plain) p = fold_row_plain(row, valid);
  for (int64_t c = plain ? valid : threadIdx.x; c < valid; c += kThreads) {
    fold_element(p, t.apply(logits.at(row[c], c)), static_cast<int32_t>(col0 + c), sum_logits, extras);
  }
  p = block_combine(p);
  if (threadIdx.x != 0) return;
  RunningStats s = running[r];
  Part a{s.max, s.sum_exp, s.sum_logits, s.weighted, 0.0, s.argmax};  // (no squares in the head)
  combine(a, p);
  s.max = a.max;
  s.sum_exp = a.sum_exp;
  s.sum_logits = a.sum_logits;
  s.weighted = a.weighted;
  s.argmax = a.argmax;
  const int64_t column = tokens.target(r) - vocab_begin - col0;
  if (column >= 0 && column < valid) s.target = t.apply(logits.at(row[column], column));
  s.columns += static_cast<int32_t>(valid);
  running[r] = s;
}

__global__ void finalize_kernel(const RunningStats* running, int64_t rows, TokenInputs tokens, int64_t vocab_begin,
                                LossParams params, int64_t width, float* stats, int64_t ld, RankHeader* header) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  const RunningStats s = running[i];
  tokens.flag_bad(i, tokens.target(i), params, header);
  float* out = stats + i * ld;
  out[0] = s.max;
  out[1] = static_cast<float>(s.sum_exp);
  out[2] = s.target;
  // The mean of the logits relative to the max (token_math.h), from the fp64 sum of z.
  out[3] = params.with_sum_logits()
               ? logit_half_mean(rebased_logit_sum(s.sum_logits, s.columns, -INFINITY, s.max), s.columns)
               : 0.0f;
  if (width == 6) {
    out[4] = int_as_float_bits(s.argmax < 0 ? -1 : static_cast<int32_t>(s.argmax + vocab_begin));
    out[5] = static_cast<float>(s.weighted);
  }
}

// One block per tile row: z <- the gradient, in place (cuda/kernels.cu's gradient_kernel,
// element for element), and optionally its two bf16 parts, or (lo null) its bf16 rounding,
// which then replaces it in z too.
__global__ void __launch_bounds__(kThreads)
    tile_gradient_kernel(float* z, int64_t ld, int64_t cols, int64_t valid, int64_t col0, TileLogits logits,
                         GradientParams p, bool plain, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  const int64_t r = blockIdx.x;
  const int64_t y = p.tokens.target(r);
  const GradientConstants k = p.constants(r, y);
  const Transform t = transform_of(p.params, r);
  const float target_term = target_weight(p.params);
  const int64_t target_column = y - p.vocab_begin - col0;
  float* row = z + r * ld;
  int64_t done = 0;  // columns the plain path took
  if (plain && !k.zero_row()) {
    // 4 columns a thread at a time where the row (and hi and lo) are aligned for them.
    const PlainGradient pg = PlainGradient::of(k, target_term);
    auto aligned = [&](const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
    if (aligned(row, 16) && (hi == nullptr || aligned(hi + r * ld, 8)) && (lo == nullptr || aligned(lo + r * ld, 8))) {
      done = cols / 4 * 4;
      for (int64_t c = 4 * threadIdx.x; c < done; c += 4 * kThreads) {
        const float4 x = *reinterpret_cast<const float4*>(row + c);
        const float zs[4] = {x.x, x.y, x.z, x.w};
        float g[4];
        pg.run(c, zs, g, target_column, valid);
        if (hi != nullptr) {
          store_run(hi + r * ld + c, g);
          float rest[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float rounded = __bfloat162float(__float2bfloat16_rn(g[j]));
            rest[j] = g[j] - rounded;
            if (lo == nullptr) g[j] = rounded;  // rounded once, as below
          }
          if (lo != nullptr) store_run(lo + r * ld + c, rest);
        }
        *reinterpret_cast<float4*>(row + c) = make_float4(g[0], g[1], g[2], g[3]);
      }
    }
  }
  for (int64_t c = done + threadIdx.x; c < cols; c += kThreads) {
    float g = 0.0f;
    if (!k.zero_row() && c < valid) {  // else a token that does not count, or padding
      g = gradient_element(k, t, logits.at(row[c], c), c == target_column, target_term);
    }
    if (hi != nullptr) {
      const __nv_bfloat16 h = __float2bfloat16_rn(g);
      hi[r * ld + c] = h;
      if (lo != nullptr) {
        lo[r * ld + c] = __float2bfloat16_rn(g - __bfloat162float(h));
      } else {
        g = __bfloat162float(h);  // rounded once: the bias sums see what the GEMM sees
      }
    }
    row[c] = g;
  }
}

// partial[s, c] <- the sum of dz[r, c] over segment s's rows, in row order.
__global__ void column_partial_kernel(const float* dz, int64_t ld, int64_t rows, int64_t cols, double* partial) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t s = blockIdx.y;
  if (c >= cols) return;
  const int64_t begin = rows * s / kColumnSegments;
  const int64_t end = rows * (s + 1) / kColumnSegments;
  double sum = 0.0;
  for (int64_t r = begin; r < end; ++r) sum += static_cast<double>(dz[r * ld + c]);
  partial[s * cols + c] = sum;
}

__global__ void column_total_kernel(const double* partial, int64_t cols, double* sums, bool first) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  double sum = 0.0;
  for (int64_t s = 0; s < kColumnSegments; ++s) sum += partial[s * cols + c];
  sums[c] = first ? sum : sums[c] + sum;
}

template <class TOut>
__global__ void store_doubles_kernel(const double* values, int64_t n, TOut* out, int64_t stride, bool accumulate) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if constexpr (std::is_same_v<TOut, float>) {
    out[i * stride] = accumulate ? out[i * stride] + static_cast<float>(values[i]) : static_cast<float>(values[i]);
  } else {
    out[i * stride] = from_float<TOut>(static_cast<float>(values[i]));
  }
}

template <class TOut>
__global__ void store_floats_kernel(const float* values, int64_t rows, int64_t cols, int64_t ld, TOut* out,
                                    int64_t ld_out) {
  const int64_t total = rows * cols;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / cols;
    const int64_t c = k % cols;
    out[r * ld_out + c] = from_float<TOut>(values[r * ld + c]);
  }
}

template <class TIn>
__global__ void widen_kernel(const TIn* in, int64_t rows, int64_t cols, int64_t ld, float* out, int64_t ld_out) {
  const int64_t total = rows * cols;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / cols;
    const int64_t c = k % cols;
    out[r * ld_out + c] = to_float(in[r * ld + c]);
  }
}

template <class T>
__global__ void poison_kernel(T* base, int64_t rows, int64_t cols, int64_t ld, const cuda::DeviceError* error) {
  if (error->code == 0) return;
  const int64_t total = rows * cols;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, double>) {
      base[(k / cols) * ld + k % cols] = NAN;
    } else {
      base[(k / cols) * ld + k % cols] = from_float<T>(NAN);
    }
  }
}

// A grid-stride launch over `total` elements: at most 4096 blocks.
unsigned strided_grid(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks > 4096 ? 4096 : blocks);
}

}  // namespace

Status init_running(RunningStats* running, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return {};
  init_running_kernel<<<grid_for(rows, kThreads), kThreads, 0, stream>>>(running, rows);
  return launched("head: running statistics");
}

Status fold_tile(const float* z, int64_t ld, int64_t rows, const TileColumns& columns, const TokenVector& targets,
                 int64_t vocab_begin, const LossParams& params, bool extras, RunningStats* running,
                 cudaStream_t stream) {
  if (rows == 0) return {};
  fold_tile_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      z, ld, columns.valid, columns.col0, tile_logits(columns), token_inputs(targets, TokenVector{}), vocab_begin,
      params, extras, is_plain(params) && !extras && columns.as_is(), running);
  return launched("head: tile statistics");
}

Status finalize_stats(const RunningStats* running, int64_t rows, const TokenVector& targets, const TokenVector& weights,
                      int64_t vocab_begin, const LossParams& params, int64_t width, float* stats, int64_t ld,
                      RankHeader* header, cudaStream_t stream) {
  if (rows == 0) return {};
  finalize_kernel<<<grid_for(rows, kThreads), kThreads, 0, stream>>>(running, rows, token_inputs(targets, weights),
                                                                     vocab_begin, params, width, stats, ld, header);
  return launched("head: statistics");
}

Status tile_gradient(float* z, int64_t ld, int64_t rows, const TileColumns& columns, const TokenVector& targets,
                     const TokenVector& weights, const TokenVector& lse, const TokenVector& grad_loss,
                     const double* shared, int64_t vocab_begin, const LossParams& params, void* hi, void* lo,
                     cudaStream_t stream, const PolicyBackwardInputs* policy) {
  if (rows == 0 || columns.cols == 0) return {};
  const GradientParams p = policy != nullptr
                               ? policy_gradient_params(targets, lse, policy->grad_log_prob, policy->grad_entropy,
                                                        policy->mean_logit, vocab_begin, params)
                               : gradient_params(targets, weights, lse, grad_loss, shared, vocab_begin, params);
  tile_gradient_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      z, ld, columns.cols, columns.valid, columns.col0, tile_logits(columns), p, is_plain(params) && columns.as_is(),
      static_cast<__nv_bfloat16*>(hi), static_cast<__nv_bfloat16*>(lo));
  return launched("head: tile gradient");
}

Status column_sums(const float* dz, int64_t ld, int64_t rows, int64_t cols, double* partial, double* sums, bool first,
                   cudaStream_t stream) {
  if (cols == 0) return {};
  column_partial_kernel<<<dim3(grid_for(cols, kThreads), static_cast<unsigned>(kColumnSegments)), kThreads, 0,
                          stream>>>(dz, ld, rows, cols, partial);
  if (Status s = launched("head: column sums"); !s.ok()) return s;
  column_total_kernel<<<grid_for(cols, kThreads), kThreads, 0, stream>>>(partial, cols, sums, first);
  return launched("head: column totals");
}

Status store_doubles(const double* values, int64_t n, void* out, DataType out_dtype, int64_t stride, bool accumulate,
                     cudaStream_t stream) {
  if (n == 0) return {};
  with_type(out_dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    store_doubles_kernel<T>
        <<<grid_for(n, kThreads), kThreads, 0, stream>>>(values, n, static_cast<T*>(out), stride, accumulate);
  });
  return launched("head: bias gradient");
}

Status store_floats(const float* values, int64_t rows, int64_t cols, int64_t ld, void* out, DataType out_dtype,
                    int64_t ld_out, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return {};
  with_type(out_dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    store_floats_kernel<T>
        <<<strided_grid(rows * cols), kThreads, 0, stream>>>(values, rows, cols, ld, static_cast<T*>(out), ld_out);
  });
  return launched("head: gradient store");
}

Status widen(const void* in, DataType dtype, int64_t rows, int64_t cols, int64_t ld, float* out, int64_t ld_out,
             cudaStream_t stream) {
  if (rows == 0 || cols == 0) return {};
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    widen_kernel<T>
        <<<strided_grid(rows * cols), kThreads, 0, stream>>>(static_cast<const T*>(in), rows, cols, ld, out, ld_out);
  });
  return launched("head: fp32 staging");
}

Status poison(void* base, DataType dtype, int64_t rows, int64_t cols, int64_t ld, const cuda::DeviceError* error,
              cudaStream_t stream) {
  if (base == nullptr || rows == 0 || cols == 0) return {};
  if (dtype == kFloat64) {  // an lse kept in fp64
    poison_kernel<double>
        <<<strided_grid(rows * cols), kThreads, 0, stream>>>(static_cast<double*>(base), rows, cols, ld, error);
    return launched("head: poisoning the outputs");
  }
  with_type(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    poison_kernel<T><<<strided_grid(rows * cols), kThreads, 0, stream>>>(static_cast<T*>(base), rows, cols, ld, error);
  });
  return launched("head: poisoning the outputs");
}

}  // namespace vpce::detail::head_cuda
