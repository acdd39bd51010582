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
//      calculate_loss, and later calculate_gradients.
//
// Every function validates all of its arguments first and returns kInvalidArgument naming
// the argument, the expected and the actual value; on any error nothing is written.
// Inputs (logits, targets, weights, lse, grad_loss) are never modified, except that the
// gradient may be written over the logits when asked (in place).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "vpce/communicator.h"
#include "vpce/status.h"
#include "vpce/tensor.h"

namespace vpce {

// This rank's part of the vocabulary: columns [vocab_begin, vocab_end) of vocab_size.
// Over the group the ranges partition [0, vocab_size); they may differ in size, and a
// range may be empty.
struct VocabShard {
  int64_t vocab_begin = 0;
  int64_t vocab_end = 0;
  int64_t vocab_size = 0;
};

enum class Reduction : int32_t { kNone = 0, kSum = 1, kMean = 2 };
enum class SmoothingSemantics : int32_t { kMegatron = 0, kPyTorch = 1 };

struct LossOptions {
  // Label smoothing a in [0, 1), with Megatron's semantics (the default), or in [0, 1]
  // with PyTorch's (F.cross_entropy takes 1: the target's weight is then 0).
  // Megatron's needs at least 2 valid classes when a > 0.
  float label_smoothing = 0.0f;
  SmoothingSemantics smoothing_semantics = SmoothingSemantics::kMegatron;
  // Tokens whose target equals this get loss 0 and a zero gradient, and are not counted.
  int64_t ignore_index = -100;
  // PaLM's z-loss: adds z_loss_weight * lse^2 per token. >= 0.
  float z_loss_weight = 0.0f;
  // Applied to the logits before everything else: z = x * logit_scale (> 0), then, when
  // softcap > 0, z = softcap * tanh(z / softcap).
  float logit_scale = 1.0f;
  float softcap = 0.0f;
  // The number of real classes Vv: columns [Vv, V) are padding and take no part in the
  // loss. 0 means every column is real.
  int64_t valid_vocab_size = 0;
  Reduction reduction = Reduction::kNone;
  // Threads used by this rank's kernels; 0 means OpenMP's default. Results do not depend
  // on it.
  int num_threads = 0;
  // Device tensors: the CUDA stream (a cudaStream_t) to run on, nullptr for the default
  // stream. Ignored on the CPU; not part of the loss (ranks may use different streams).
  void* stream = nullptr;
};

// The per-token statistics of one rank (calculate_local_stats) or of the whole group
// (merge_stats): all that crosses ranks, fp32. A stats tensor is a float32 [N, 4] tensor
// whose rows are TokenStats (16 bytes per token), or [N, 6] when the per-token extras
// (argmax, entropy) are wanted: then each row continues with TokenStatsExtras.
struct TokenStats {
  float max;           // max_v z_v over the columns, -inf if none or all -inf
  float sum_exp;       // sum_v exp(z_v - max), 0 if max is -inf
  float target_logit;  // z_target if the target is among the columns, else -inf
  float sum_logits;    // with label smoothing (else 0): half the mean of z_v - max over
                       // the valid columns (0 for none; of z_v when max is -inf)
};
static_assert(sizeof(TokenStats) == 16);
struct TokenStatsExtras {
  int32_t argmax;          // the smallest global column index holding `max`, -1 if none
  float weighted_offsets;  // sum_v exp(z_v - max) (z_v - max), for the entropy
};
static_assert(sizeof(TokenStatsExtras) == 8);
inline constexpr int64_t kStatsWidth = 4;
inline constexpr int64_t kStatsWidthWithExtras = 6;

// Optional per-token tensors of the forward, each float32 with one element per token.
// Inputs: `weights` (a loss weight or a 0/1 mask; finite). Outputs, computed in the same
// pass with no further collective: `target_is_argmax` (1 where the target holds the largest
// logit, ties going to the smallest column index, the same on every rank; 0 for tokens
// not counted: ignored, or of weight 0) and `entropy` (of softmax(z), in nats).
struct ForwardExtras {
  const TensorView* weights = nullptr;
  const TensorView* target_is_argmax = nullptr;
  const TensorView* entropy = nullptr;
};

// Scratch memory for forward(), kept between calls so that the hot path does not
// allocate once it has grown to the largest size seen.
class Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(Workspace&&) noexcept;  // the moved-from one is empty, and usable as a new one
  Workspace& operator=(Workspace&&) noexcept;
  // Bytes currently held (host memory).
  std::size_t capacity() const;

  // Device tensors: errors only the device can see (a target out of range on some rank,
  // ranks that disagree) are asynchronous, as CUDA's own are: forward() returns success,
  // the outputs are NaN, and this call, which waits for the stream of the last forward that
  // used this workspace, returns the error (the same on every rank). Success on the CPU.
  Status device_status();

  struct Buffers;  // opaque

 private:
  friend struct WorkspaceAccess;
  std::unique_ptr<Buffers> buffers_;
};

// ---- one call ------------------------------------------------------------------------

// Forward. logits: [..., Vr] fp32/bf16/fp16, the last dimension contiguous, the leading
// dimensions collapsing to one row stride >= Vr. targets: int32/int64, one per token, in
// [0, Vv) or equal to ignore_index. lse: one per token, to keep for the backward: float64
// (recommended: the backward's gradient then keeps fp32's accuracy for logits up to about
// 1e9, beyond which 2^-53 |lse| relative), or float32 (4 bytes fewer per token, but its rounding costs the gradient 2^-24 |lse|
// relative: 6e-4 at logits of 1e4). loss: float32, one per token for Reduction::kNone, one element otherwise. Collective over
// `comm`: exactly one all_gather, which also carries each rank's arguments, so every rank
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
Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets,
               const VocabShard& shard, const LossOptions& options, const TensorView& loss,
               const TensorView& lse, const ForwardExtras& extras = {},
               Workspace* workspace = nullptr);

// Backward: no collective. Needs only this rank's logits, the targets, the lse saved by
// the forward, the upstream gradient grad_loss (float32: one per token for kNone, one
// element otherwise) and the weights given to the forward, if any. grad_logits: [..., Vr]
// fp32/bf16/fp16; it may be the logits view itself (in place: same data, dtype and
// strides), otherwise it must not overlap the logits.
Status backward(const TensorView& logits, const TensorView& targets, const TensorView& lse,
                const TensorView& grad_loss, const VocabShard& shard,
                const LossOptions& options, const TensorView& grad_logits,
                const TensorView* weights = nullptr);

// ---- staged ---------------------------------------------------------------------------

// Stage 1, per rank, no communication: stats [N, 4] (or [N, 6] with extras) float32 of
// this rank's columns.
Status calculate_local_stats(const TensorView& logits, const TensorView& targets,
                             const VocabShard& shard, const LossOptions& options,
                             const TensorView& stats);

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
                      const LossOptions& options, const TensorView& loss,
                      const TensorView& lse, const ForwardExtras& extras = {});

// Stage 4: the gradient; the same function as backward().
inline Status calculate_gradients(const TensorView& logits, const TensorView& targets,
                                  const TensorView& lse, const TensorView& grad_loss,
                                  const VocabShard& shard, const LossOptions& options,
                                  const TensorView& grad_logits,
                                  const TensorView* weights = nullptr) {
  return backward(logits, targets, lse, grad_loss, shard, options, grad_logits, weights);
}

}  // namespace vpce
