// vpce/loss.h: the vocab-parallel cross-entropy loss and its gradient.
//
// Rank r of a tensor-parallel group holds the columns [vocab_begin, vocab_end) of the
// logits x, a [..., vocab_end - vocab_begin] tensor whose leading dimensions are the tokens
// (Megatron's [s, b, V/tp]). Per token i with target y_i, over the global vocabulary's
// valid columns (all V of them, or the first valid_vocab_size =: Vv):
//
//   z_iv   = x_iv * logit_scale, then softcap * tanh(z_iv / softcap) when softcap > 0
//   lse_i  = log sum_v exp(z_iv)
//   loss_i = w_i [ (1 - s) (lse_i - z_i,y_i) + s (lse_i - sum_v z_iv / Vv) + zl lse_i^2 ]
//   dloss_i / dz_iv = w_i [ p_iv (1 + 2 zl lse_i) - (1 - s) [v == y_i] - s / Vv ]
//
// with p_iv = exp(z_iv - lse_i), label smoothing a giving s = a Vv / (Vv - 1) (Megatron's
// semantics: the target gets 1 - a, every other class a / (Vv - 1)) or s = a (PyTorch's:
// the target distribution is (1 - a) onehot + a / Vv), zl the z-loss weight, and w_i the
// token's weight (1 by default; 0 for a token whose target is ignore_index). Padding
// columns [Vv, V) get no probability and a zero gradient. The reduction is none, sum, or
// the weighted mean sum_i loss_i / sum_i w_i over the counted tokens (0 if none counts).
//
// Two ways to call it:
//  - one call: forward() (one all-gather through a Communicator) and backward() (none);
//  - staged, for frameworks that run their own collective (Megatron's static helpers):
//      calculate_local_stats -> all-gather the [N, W] stats yourself -> merge_stats ->
//      calculate_loss, and later calculate_gradients. The stages trust one another: give
//      each the same targets, options, vocabulary size and shards (the statistics do not
//      record them; forward() checks them across ranks, the stages cannot: a mismatch gives a
//      wrong loss with success, docs/reliability.md).
//
// Every function validates all of its arguments first and returns kInvalidArgument naming
// the argument, the expected and the actual value; on any error nothing is written.
// Inputs (logits, targets, weights, lse, grad_loss) are never modified, except that the
// gradient may be written over the logits when asked (in place).
#pragma once

#include <cstdint>
#include <span>

#include "vpce/communicator.h"
#include "vpce/options.h"  // IWYU pragma: export
#include "vpce/status.h"
#include "vpce/tensor.h"
#include "vpce/workspace.h"  // IWYU pragma: export

namespace vpce {

// ---- one call ------------------------------------------------------------------------

// Forward. logits: [..., Vr] fp32/bf16/fp16, the last dimension contiguous, the leading
// dimensions collapsing to one row stride >= Vr. targets: int32/int64, one per token, in
// [0, Vv) or equal to ignore_index. lse: one per token, to keep for the backward: float64
// (recommended: the backward's gradient then keeps fp32's accuracy for logits up to about
// 1e9, beyond which 2^-53 |lse| relative), or float32 (4 bytes fewer per token, but its rounding costs the gradient
// 2^-24 |lse| relative: 6e-4 at logits of 1e4). loss: float32, one per token for Reduction::kNone, one element
// otherwise. Collective over `comm`: exactly one all_gather, which also carries each rank's arguments, so every rank
// checks that the group agrees (tokens, V, a partition of [0, V), dtype, options, targets,
// weights) and every rank returns the same error if it does not. Every rank gets the
// bit-identical loss. `workspace` may be null (then forward allocates).
//
// Device tensors (CUDA; every tensor on the same device, vpce built with CUDA): `comm` must
// gather device memory (NcclCommunicator, vpce/nccl.h); `workspace` is required (it holds
// the device buffers, grown with cudaMallocAsync and then reused: run one call before
// capturing a CUDA graph); everything runs on options.stream without waiting for it; errors
// the host can see come back here, those only the device can see from
// workspace->device_status(). The targets' and weights' values are checked on the device
// but not hashed, so ranks given different targets are not detected there.
Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets, const VocabShard& shard,
               const LossOptions& options, const TensorView& loss, const TensorView& lse,
               const ForwardExtras& extras = {}, Workspace* workspace = nullptr);

// Backward: no collective. Needs only this rank's logits, the targets, the lse saved by
// the forward, the upstream gradient grad_loss (float32: one per token for kNone, one
// element otherwise) and the weights given to the forward, if any. grad_logits: [..., Vr]
// fp32/bf16/fp16; it may be the logits view itself (in place: same data, dtype and
// strides), otherwise it must not overlap the logits.
Status backward(const TensorView& logits, const TensorView& targets, const TensorView& lse, const TensorView& grad_loss,
                const VocabShard& shard, const LossOptions& options, const TensorView& grad_logits,
                const TensorView* weights = nullptr);

// ---- staged ---------------------------------------------------------------------------

// Stage 1, per rank, no communication: stats [N, 4] (or [N, 6] with extras) float32 of
// this rank's columns.
Status calculate_local_stats(const TensorView& logits, const TensorView& targets, const VocabShard& shard,
                             const LossOptions& options, const TensorView& stats);

// Stage 2: gathered [R, N, W] float32 (rank r's stats at [r]) -> stats [N, W], merged in
// rank order, so every rank that merges the same gathered stats gets the same bits.
// shards: rank r's VocabShard at [r], in the order of `gathered` (their non-empty ranges
// partition [0, vocab_size)). Needed with label smoothing when R > 1: each rank's mean of
// the logits is relative to its own max, and the merge weighs it by the rank's column
// count (shards in another order than the stats give a wrong smoothed loss). Optional
// otherwise, and checked when given.
Status merge_stats(const TensorView& gathered, const LossOptions& options, const TensorView& stats);
Status merge_stats(const TensorView& gathered, const LossOptions& options, const TensorView& stats,
                   std::span<const VocabShard> shards);

// Stage 3: merged stats [N, W] and the targets -> loss and lse, and the extras (which
// need W = 6 for target_is_argmax and entropy). vocab_size is the global V.
Status calculate_loss(const TensorView& stats, const TensorView& targets, int64_t vocab_size,
                      const LossOptions& options, const TensorView& loss, const TensorView& lse,
                      const ForwardExtras& extras = {});

// Stage 4: the gradient; the same function as backward().
inline Status calculate_gradients(const TensorView& logits, const TensorView& targets, const TensorView& lse,
                                  const TensorView& grad_loss, const VocabShard& shard, const LossOptions& options,
                                  const TensorView& grad_logits, const TensorView* weights = nullptr) {
  return backward(logits, targets, lse, grad_loss, shard, options, grad_logits, weights);
}

}  // namespace vpce
