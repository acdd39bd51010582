// head/cuda/head_kernels.h: the fused head's CUDA epilogue kernels (head_kernels.cu), on
// validated arguments whose pointers are device memory. Each tile of logits z = h W^T comes
// from a cuBLAS GEMM into an fp32 buffer [rows, cols] (row stride ld); these kernels add
// the bias as they read it and run the loss's per-element arithmetic of src/cuda/kernels.cu
// (the same transform, the same online (max, sum of exp) fold and fixed combining tree, the
// same gradient formula through src/common/token_math.h). Every launch is asynchronous on
// `stream`; none synchronises with the host, so every call can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/token_math.h"
#include "../../cuda/device.h"
#include "../../protocol.h"
#include "../../validate.h"

namespace vpce::detail::head_cuda {

// One token's statistics over the columns folded so far, in column order (40 bytes).
struct RunningStats {
  float max;          // -inf while empty (or while every element was -inf or NaN)
  int32_t argmax;     // shard-local column of the first max, -1 if none
  double sum_exp;     // sum exp(z - max)
  double sum_logits;  // sum z (label smoothing only; the statistics take it relative to max)
  double weighted;    // sum exp(z - max)(z - max) (extras only)
  float target;       // the transformed target logit, -inf if not among this shard's columns
  int32_t columns;    // the valid columns folded so far
};
static_assert(sizeof(RunningStats) == 40);

// The tile's columns: [col0, col0 + cols) of this rank's V_r rows, `valid` of them real
// classes (the others padding), the bias (T = the operands' dtype; null for none), and the
// rounding of HeadOptions::round_logits (the operands' dtype; fp32: none).
struct TileColumns {
  int64_t col0 = 0;
  int64_t cols = 0;
  int64_t valid = 0;
  const void* bias = nullptr;  // at bias + col * bias_stride elements
  int64_t bias_stride = 0;
  DataType dtype{};  // of the bias
  DataType rounding = kFloat32;
  // Whether the tile's values are its logits as they stand (no bias, no rounding).
  bool as_is() const { return bias == nullptr && rounding == kFloat32; }
};

// running[0, rows) <- empty.
Status init_running(RunningStats* running, int64_t rows, cudaStream_t stream);

// Folds each of the tile's rows (z[r * ld + c], rows of it) into running[r], after the
// columns folded before (and takes the target logit when the tile holds it). `targets`
// starts at the tile's first token; vocab_begin is the shard's first global column.
Status fold_tile(const float* z, int64_t ld, int64_t rows, const TileColumns& columns, const TokenVector& targets,
                 int64_t vocab_begin, const LossParams& params, bool extras, RunningStats* running,
                 cudaStream_t stream);

// running[0, rows) -> stats [rows, width] (row stride ld) as calculate_local_stats writes
// them. A target outside [0, Vv) that is not ignore_index, or a weight that is negative or
// not finite, sets header->status (when header is not null), as cuda::local_stats does.
Status finalize_stats(const RunningStats* running, int64_t rows, const TokenVector& targets, const TokenVector& weights,
                      int64_t vocab_begin, const LossParams& params, int64_t width, float* stats, int64_t ld,
                      RankHeader* header, cudaStream_t stream);

// The logit gradient of a tile, in place: z [rows, cols] (row stride ld) <- dloss/dx, the
// formula of src/cuda/kernels.cu's gradient kernel (0 on padding columns and for tokens
// that do not count). The upstream gradient is shared (*shared, for a reduction) or per
// token (grad_loss). With `hi` and `lo` (bf16, [rows, cols], row stride ld), also writes
// the gradient split in two bf16 parts, hi = bf16(g), lo = bf16(g - hi); with `hi` alone,
// hi = bf16(g) and z <- hi's values (bf16_logit_gradients). With `policy`, the RL outputs'
// gradient instead (its upstream gradients and E_p[z], from the tile's first token; weights,
// grad_loss and shared unused).
Status tile_gradient(float* z, int64_t ld, int64_t rows, const TileColumns& columns, const TokenVector& targets,
                     const TokenVector& weights, const TokenVector& lse, const TokenVector& grad_loss,
                     const double* shared, int64_t vocab_begin, const LossParams& params, void* hi, void* lo,
                     cudaStream_t stream, const PolicyBackwardInputs* policy = nullptr);

// Column sums of dz [rows, cols] (row stride ld) in a fixed order, in fp64, added into
// sums[0, cols) (or written over them when `first`). `partial` holds kColumnSegments * cols
// doubles.
inline constexpr int64_t kColumnSegments = 64;
Status column_sums(const float* dz, int64_t ld, int64_t rows, int64_t cols, double* partial, double* sums, bool first,
                   cudaStream_t stream);

// out[r, c] (dtype out_dtype: fp32, bf16 or fp16; row stride ld_out) <- from fp64 or fp32
// values: written over, or added into (fp32 only) when accumulate.
Status store_doubles(const double* values, int64_t n, void* out, DataType out_dtype, int64_t stride, bool accumulate,
                     cudaStream_t stream);
Status store_floats(const float* values, int64_t rows, int64_t cols, int64_t ld, void* out, DataType out_dtype,
                    int64_t ld_out, cudaStream_t stream);

// out [rows, cols] fp32 (row stride ld_out) <- in [rows, cols] of dtype (row stride ld).
Status widen(const void* in, DataType dtype, int64_t rows, int64_t cols, int64_t ld, float* out, int64_t ld_out,
             cudaStream_t stream);

// When *error is set: every element of the [rows, cols] matrix (row stride ld, dtype fp32,
// bf16 or fp16) becomes NaN. Otherwise nothing is written (each block returns at once).
Status poison(void* base, DataType dtype, int64_t rows, int64_t cols, int64_t ld, const cuda::DeviceError* error,
              cudaStream_t stream);

}  // namespace vpce::detail::head_cuda
