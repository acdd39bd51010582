// vpce/rl.h: what a reinforcement-learning trainer (PPO, GRPO...) needs of a vocab-parallel
// policy: each token's log-probability of its sampled token and the policy's entropy, both
// differentiable, with one all-gather per forward and no collective in the backward.
//
// Rank r holds the columns [vocab_begin, vocab_end) of the logits x ([..., Vr], the leading
// dimensions the tokens), as for the loss (vpce/loss.h). Per token i with its sampled token
// y_i and temperature T_i, over the valid columns v of the global vocabulary:
//
//   z_iv        = transform(x_iv) / T_i      (transform: logit_scale, then the soft cap)
//   log_prob_i  = z_iy - log sum_v exp(z_iv)  = log p_iy
//   entropy_i   = -sum_v p_iv log p_iv        = lse_i - E_p[z_i]
//
// and the gradient of sum_i (g_lp,i log_prob_i + g_H,i entropy_i) for any upstream g_lp, g_H:
//
//   d/dx_iv = dz_iv/dx_iv [ g_lp,i (1[v = y_i] - p_iv) - g_H,i p_iv (z_iv - E_p[z_i]) ]
//
// The same outputs of a fused output layer's logits x = h W_r^T + b_r (vpce/head.h) without
// building them: linear_forward and linear_backward (the head's recompute mode), or
// linear_forward_backward (its chunked mode) when the upstream gradients are known before
// the forward.
//
// A token equal to ignore_index (a prompt or padding position) gets 0 for both outputs and a
// zero gradient. Padding columns [Vv, V) take no probability. The forward keeps, per token,
// the lse and E_p[z] for the backward (16 bytes in float64), nothing of size V.
//
// Every function validates all of its arguments first and returns kInvalidArgument naming
// the argument, the expected and the actual value; on any error nothing is written. The
// forward's one all_gather also carries each rank's arguments (tokens, V, ranges, dtype,
// options, a hash of the targets and the temperatures), so ranks that disagree all return
// the same error rather than a wrong result.
#pragma once

#include <cstdint>

#include "vpce/communicator.h"
#include "vpce/head.h"
#include "vpce/options.h"  // IWYU pragma: export
#include "vpce/status.h"
#include "vpce/tensor.h"
#include "vpce/workspace.h"  // IWYU pragma: export

namespace vpce::rl {

struct Options {
  // The sampling temperature T of every token, unless per-token temperatures are given (then
  // this must stay 1): finite, > 0, and large enough that logit_scale / T and softcap / T are
  // finite in fp32 (T >= about 2.94e-39 at logit_scale 1; the error names the bound).
  float temperature = 1.0f;
  // Tokens whose target equals this get 0 and a zero gradient.
  int64_t ignore_index = -100;
  // As the loss's (vpce/options.h): z = x * logit_scale, then softcap * tanh(z / softcap)
  // when softcap > 0, before the temperature.
  float logit_scale = 1.0f;
  float softcap = 0.0f;
  // The real classes Vv: columns [Vv, V) are padding (0: every column is real).
  int64_t valid_vocab_size = 0;
  // Threads of this rank's kernels (0: OpenMP's default); results do not depend on it.
  int num_threads = 0;
  // Device tensors: the CUDA stream (a cudaStream_t) to run on, nullptr for the default stream
  // (as the loss's, vpce/loss.h: the device forward needs a Workspace and a communicator that
  // gathers device memory; the temperatures' and targets' values are checked on the device,
  // not hashed). Ignored on the CPU.
  void* stream = nullptr;
};

// The forward's per-token outputs, each with one element per token; null when not wanted.
struct Outputs {
  const TensorView* log_prob = nullptr;    // float32
  const TensorView* entropy = nullptr;     // float32, in nats
  const TensorView* lse = nullptr;         // float64 (or float32): for the backward
  const TensorView* mean_logit = nullptr;  // float64 (or float32): E_p[z], for the entropy's backward
  // float32: sum_v p_v^2 (verl's sum_pi_squared, for its optimal-baseline estimators); no
  // gradient flows through it. Asking for it adds 8 bytes a token to the gather.
  const TensorView* sum_p_squared = nullptr;
};

// Forward. logits: [..., Vr] fp32/bf16/fp16 (the last dimension contiguous, the leading ones
// collapsing to one row stride). targets: int32/int64, the sampled token of each row, in
// [0, Vv) or ignore_index. temperatures: float32, one per token, each as options.temperature
// must be, or null for options.temperature. Collective over `comm`: exactly one all_gather. `workspace` may be
// null (then forward allocates). Every rank gets the bit-identical outputs.
Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets, const VocabShard& shard,
               const Options& options, const Outputs& outputs, const TensorView* temperatures = nullptr,
               Workspace* workspace = nullptr);

// The upstream gradients, float32 with one element per token; null for zeros.
struct Upstream {
  const TensorView* grad_log_prob = nullptr;
  const TensorView* grad_entropy = nullptr;
};

// Backward: no collective. lse (and mean_logit, needed when upstream.grad_entropy is given)
// as the forward wrote them; the same targets, temperatures, shard and options.
// grad_logits: [..., Vr] fp32/bf16/fp16, written (not accumulated); it may be the logits
// view itself (in place), otherwise it must not overlap the logits.
Status backward(const TensorView& logits, const TensorView& targets, const TensorView& lse,
                const TensorView* mean_logit, const Upstream& upstream, const VocabShard& shard, const Options& options,
                const TensorView& grad_logits, const TensorView* temperatures = nullptr);

// ---- in the fused head ------------------------------------------------------------------

// Forward of the logits x = h W_r^T + b_r that are never built (vpce/head.h: the operands,
// the tiles, HeadOptions, the recompute mode): the outputs as forward() gives them for x,
// with one all_gather (every rank also checks that the group agrees on H and round_logits).
Status linear_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets, const VocabShard& shard,
                      const Options& options, const HeadOptions& head, const Outputs& outputs,
                      const TensorView* temperatures = nullptr, Workspace* workspace = nullptr);

// Backward: no collective. Recomputes the tiles and writes or adds the gradients asked for
// (HeadGradients: grad_hidden is this rank's part, to be summed over the group as for the
// loss; all_reduce_hidden_gradient does it), from the forward's lse and mean_logit and the
// upstream gradients, as backward() for x.
Status linear_backward(const HeadInputs& inputs, const TensorView& targets, const TensorView& lse,
                       const TensorView* mean_logit, const Upstream& upstream, const VocabShard& shard,
                       const Options& options, const HeadOptions& head, const HeadGradients& gradients,
                       const TensorView* temperatures = nullptr, Workspace* workspace = nullptr);

// Chunked mode (vpce/head.h): forward and backward at once, when the upstream gradients do
// not depend on this call's outputs, e.g. an on-policy step (one update per rollout, as
// GRPO's and REINFORCE's usual setting: the importance ratio is 1 and the gradient of the
// loss with respect to log_prob_i is -A_i times the token's weight), or an entropy bonus of
// fixed weights. The outputs are linear_forward's bit for bit; the gradients are
// linear_backward's for `upstream` (their fp32 sums in another order). Three GEMMs instead of
// four. Collective: one all_gather per chunk of head.chunk_tokens tokens; `collectives`, when
// not null, gets the number made, also on failure. Every rank passes the same upstream
// gradients (on the CPU their values are hashed and compared at the first gather; device
// tensors' values are not read on the host). On device tensors, sum_p_squared is refused
// (kUnsupported) in every head entry. A communication
// failure at a later chunk leaves the earlier chunks' gradients written or added, as
// vpce::linear_cross_entropy_forward_backward's do.
Status linear_forward_backward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                               const VocabShard& shard, const Options& options, const HeadOptions& head,
                               const Upstream& upstream, const Outputs& outputs, const HeadGradients& gradients,
                               const TensorView* temperatures = nullptr, Workspace* workspace = nullptr,
                               int64_t* collectives = nullptr);

}  // namespace vpce::rl
