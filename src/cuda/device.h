// cuda/device.h: the CUDA kernels' launchers (kernels.cu), on validated arguments whose
// pointers are device memory. Every launch is asynchronous on `stream`; none waits for the
// device, so a forward or backward can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/token_math.h"
#include "../cpu/kernels.h"
#include "../protocol.h"
#include "../validate.h"
#include "dispatch.h"

namespace vpce::detail::cuda {

// Written by the device when the gathered headers do not describe one call (a rank's bad
// target, ranks that disagree): the outputs are then NaN, and Workspace::device_status()
// builds the message from the same headers on the host.
inline constexpr int kGroupCheckFailed = 1;
struct DeviceError {
  int code;
};

// logits [N, Vr] -> stats [N, W] (row stride W). A target outside [0, Vv) that is not
// ignore_index, or a weight that is negative or not finite, sets `header`'s status (the header already
// in the send buffer, its message prepared by the host), so that every rank learns of it
// from the gather.
Status local_stats(const RowMatrix& logits, const TokenVector& targets, const TokenVector& weights, int64_t vocab_begin,
                   const LossParams& params, const RowMatrix& stats, RankHeader* header, cudaStream_t stream);

// This rank's header into its send buffer.
Status write_header(const RankHeader& header, RankHeader* out, cudaStream_t stream);

// The gathered headers (rank r's at gathered + r * stride bytes) against each other.
Status check_group(const char* gathered, int64_t stride, int ranks, DeviceError* error, cudaStream_t stream);

// Ranks' stats (rank r's [N, W] at gathered + r * rank_stride floats) -> merged [N, W] ->
// the outputs; `terms` holds N doubles for a reduction. Outputs are NaN if *error is set.
Status merge_and_loss(const float* gathered, int64_t rank_stride, int ranks, int64_t rows, int64_t width, float* merged,
                      const TokenVector& targets, const TokenVector& weights, const LossParams& params,
                      const LossOutputs& out, double* terms, const DeviceError* error, cudaStream_t stream);

// The RL outputs' merge: ranks' stats [N, 6] -> merged -> each wanted output of `out`
// (token_math.h's token_policy), NaN if *error is set.
Status merge_and_policy(const float* gathered, int64_t rank_stride, int ranks, int64_t rows, int64_t width,
                        float* merged, const TokenVector& targets, const LossParams& params,
                        const PolicyForwardOutputs& out, const DeviceError* error, cudaStream_t stream);

// The reduced loss (sum, or mean over the counted weight of the `rows` tokens) of the
// per-token terms that merge_and_loss wrote, as merge_and_loss reduces them: for the fused
// head's chunks (head/cuda/), whose terms are reduced once over every chunk's tokens.
Status reduce_loss(const double* terms, int64_t rows, const TokenVector& targets, const TokenVector& weights,
                   const LossParams& params, float* loss, const DeviceError* error, cudaStream_t stream);

// The upstream gradient shared by every token of a reduced loss, into *out (device memory):
// (grad_loss given ? *grad_loss : value), divided by the counted weight of all `rows` tokens
// for kMean. For the loss's gradient and the fused head's.
Status shared_upstream(const float* grad_loss, float value, const TokenVector& targets, const TokenVector& weights,
                       int64_t rows, const LossParams& params, double* out, cudaStream_t stream);

// logits [N, Vr] -> grad [N, Vr] (may be the logits); `shared_upstream` holds one double
// for a reduced loss. With `policy`, the RL outputs' gradient (grad_loss unused).
Status gradient(const RowMatrix& logits, const TokenVector& targets, const TokenVector& weights, const TokenVector& lse,
                const TokenVector& grad_loss, int64_t vocab_begin, const LossParams& params, const RowMatrix& grad,
                double* shared_upstream, cudaStream_t stream, const PolicyBackwardInputs* policy = nullptr);

}  // namespace vpce::detail::cuda
