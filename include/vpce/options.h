// vpce/options.h: the types every vpce operation shares: this rank's part of the
// vocabulary, the loss's options and reduction, the per-token statistics that cross ranks,
// and the forward's optional per-token tensors. Included by vpce/loss.h and vpce/head.h.
#pragma once

#include <cstdint>

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
// kMegatron: the target keeps 1 - s, every other valid class s / (Vv - 1), s the label
// smoothing; the same loss on every rank. kPyTorch: F.cross_entropy's (1 - s) onehot + s / Vv.
// kMegatronLegacy: Megatron's vocab_parallel_cross_entropy(label_smoothing=s), which smooths
// over this rank's shard only: with K the shard's valid columns and s' = s K / (K - 1), the
// loss (1 - s') (lse - z_target) + s' (lse - mean of the shard's z) and its gradient
// p - (1 - s') onehot - s' / K, different on every rank (for parity with Megatron's runs).
enum class SmoothingSemantics : int32_t { kMegatron = 0, kPyTorch = 1, kMegatronLegacy = 2 };

struct LossOptions {
  // Label smoothing a in [0, 1), with Megatron's semantics (the default) or its legacy
  // per-shard ones, or in [0, 1] with PyTorch's (F.cross_entropy takes 1: the target's weight
  // is then 0). Megatron's needs at least 2 valid classes when a > 0, the legacy ones 2 valid
  // columns on every rank; the legacy ones only through forward() and backward() and the
  // head (the staged calculate_loss and merge_stats do not know the rank's shard).
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

}  // namespace vpce
