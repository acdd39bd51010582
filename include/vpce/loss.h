// vpce/loss.h: the vocab-parallel cross-entropy loss and its gradient.
//
// Rank r of a tensor-parallel group holds the columns [vocab_begin, vocab_end) of the
// logits, a [..., vocab_end - vocab_begin] tensor whose leading dimensions are the tokens
// (Megatron's [s, b, V/tp]). For token i with target y_i and logits z_i over the global
// vocabulary of V columns, and label smoothing a (Megatron's semantics, computed exactly
// with the global V: s = a V / (V - 1)):
//
//   lse_i  = log sum_v exp(z_iv)
//   loss_i = (1 - s) (lse_i - z_i,y_i) + s (lse_i - sum_v z_iv / V)
//   dloss_i / dz_iv = p_iv - (1 - s) [v == y_i] - s / V,   p_iv = exp(z_iv - lse_i)
//
// Two ways to call it:
//  - one call: forward() (one all-gather through a Communicator) and backward() (none);
//  - staged, for frameworks that run their own collective (Megatron's static helpers):
//      calculate_local_stats  -> all-gather the [N, 4] stats yourself ->
//      merge_stats            -> calculate_loss            ... later: calculate_gradients.
//
// Every function validates all of its arguments first and returns kInvalidArgument naming
// the argument, the expected and the actual value; on any error nothing is written.
// Inputs (logits, targets, lse, grad_loss) are never modified, except that
// calculate_gradients may be asked to write the gradient over the logits (in place).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

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

struct LossOptions {
  // Megatron's label smoothing, in [0, 1): the target gets 1 - a and every other class
  // a / (V - 1), V being the global vocabulary. Needs V >= 2 when a > 0.
  float label_smoothing = 0.0f;
  // Threads used by this rank's kernels; 0 means OpenMP's default. Results do not depend
  // on it.
  int num_threads = 0;
};

// The per-token statistics of one rank (calculate_local_stats) or of the whole group
// (merge_stats): all that crosses ranks, 16 bytes per token, fp32. A stats tensor is a
// float32 [N, 4] tensor whose rows are TokenStats.
struct TokenStats {
  float max;           // max_v z_v over the columns, -inf if none or all -inf
  float sum_exp;       // sum_v exp(z_v - max), 0 if max is -inf
  float target_logit;  // z_target if the target is among the columns, else -inf
  float sum_logits;    // sum_v z_v (only computed with label smoothing, else 0)
};
static_assert(sizeof(TokenStats) == 16);

// Scratch memory for forward(), kept between calls so that the hot path does not
// allocate once it has grown to the largest size seen.
class Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(Workspace&&) noexcept;
  Workspace& operator=(Workspace&&) noexcept;
  // Bytes currently held.
  std::size_t capacity() const;

  struct Buffers;  // opaque

 private:
  friend struct WorkspaceAccess;
  std::unique_ptr<Buffers> buffers_;
};

// ---- one call ------------------------------------------------------------------------

// Forward. logits: [..., Vr] fp32/bf16/fp16, the last dimension contiguous, the leading
// dimensions collapsing to one row stride >= Vr. targets: int32/int64 with the leading
// shape. loss, lse: float32 with the leading shape (any stride). Collective over `comm`:
// exactly one all_gather, which also carries each rank's arguments, so every rank checks
// that the group agrees (tokens, V, a partition of [0, V), dtype, options, targets) and
// every rank returns the same error if it does not. Every rank gets the bit-identical
// loss. `workspace` may be null (then forward allocates).
Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets,
               const VocabShard& shard, const LossOptions& options, const TensorView& loss,
               const TensorView& lse, Workspace* workspace = nullptr);

// Backward: no collective. Needs only this rank's logits, the targets, the lse saved by
// the forward and the per-token upstream gradient grad_loss (float32, leading shape).
// grad_logits: [..., Vr] fp32/bf16/fp16; it may be the logits view itself (in place:
// same data, dtype and strides), otherwise it must not overlap the logits.
Status backward(const TensorView& logits, const TensorView& targets, const TensorView& lse,
                const TensorView& grad_loss, const VocabShard& shard,
                const LossOptions& options, const TensorView& grad_logits);

// ---- staged ---------------------------------------------------------------------------

// Stage 1, per rank, no communication: stats [N, 4] float32 of this rank's columns.
Status calculate_local_stats(const TensorView& logits, const TensorView& targets,
                             const VocabShard& shard, const LossOptions& options,
                             const TensorView& stats);

// Stage 2: gathered [R, N, 4] float32 (rank r's stats at [r]) -> stats [N, 4], merged in
// rank order, so every rank that merges the same gathered stats gets the same bits.
Status merge_stats(const TensorView& gathered, const LossOptions& options,
                   const TensorView& stats);

// Stage 3: merged stats [N, 4] -> loss and lse (float32, shape [N] or any shape of N
// elements). vocab_size is the global V.
Status calculate_loss(const TensorView& stats, int64_t vocab_size, const LossOptions& options,
                      const TensorView& loss, const TensorView& lse);

// Stage 4: the gradient; the same function as backward().
inline Status calculate_gradients(const TensorView& logits, const TensorView& targets,
                                  const TensorView& lse, const TensorView& grad_loss,
                                  const VocabShard& shard, const LossOptions& options,
                                  const TensorView& grad_logits) {
  return backward(logits, targets, lse, grad_loss, shard, options, grad_logits);
}

}  // namespace vpce
