// vpce/rows.h: row kernels for frameworks that compose the loss from steps of their own,
// as Megatron-LM's static helpers (VocabParallelCrossEntropy.calculate_logits_max,
// exp_logits_inplace, calculate_predicted_logits) do: the row max, widening to fp32 in the
// same read, and exp(x - shift) in place with the row sums in the same pass, on vpce's SIMD
// kernels and threads. CPU tensors only; `[..., K]` views whose leading dimensions collapse
// to one row stride, the last dimension contiguous. Every argument is validated first (an
// error names it, the expected and the actual value) and nothing is written on error.
#pragma once

#include "vpce/status.h"
#include "vpce/tensor.h"

namespace vpce {

// logits [..., K] (float32, bfloat16 or float16) -> max [...] float32: each row's max, NaN
// where the row holds a NaN (as torch.max), -inf for K = 0. When `widened` is given (float32
// [..., K], not overlapping the logits), the logits are also written there as float32, in
// the same read. num_threads: 0 for OpenMP's default.
Status row_max(const TensorView& logits, const TensorView& max, const TensorView* widened = nullptr,
               int num_threads = 0);

// x [..., K] float32, in place: x[i, v] <- exp(x[i, v] - shift[i]) (the difference rounded to
// float32, then vpce's exponential, within 1.25 ulp of the exact value; 1.1 measured); when `sums` is given (float32
// [...]), sums[i] <- sum_v of the new x[i, v], accumulated in float64 across chunks.
Status exp_rows_in_place(const TensorView& x, const TensorView& shift, const TensorView* sums = nullptr,
                         int num_threads = 0);

// The SIMD target vpce's CPU kernels run on this CPU, as Highway names it ("AVX3_SPR",
// "AVX3", "AVX2", "SSE4", ...): what a benchmark or an accuracy report should state.
const char* cpu_kernel_target();

}  // namespace vpce
