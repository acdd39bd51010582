// vpce/head.h: the fused output layer: linear + vocab-parallel cross-entropy without the
// logits.
//
// Rank r holds the rows [vocab_begin, vocab_end) of the output weight, W_r [V_r, H] (as
// Megatron's ColumnParallelLinear output layer), an optional bias b_r [V_r], and the hidden
// states h [N, H] of the same N tokens on every rank. Its logits would be
//
//   x = h W_r^T + b_r                                  [N, V_r]
//
// and the loss is vpce's loss of x (vpce/loss.h: every LossOptions option, the same
// formulas, the same one all-gather, the same agreement checks). The logits are never
// built: they exist one [token_block, vocab_block] fp32 tile at a time, produced by a BLAS
// GEMM (fp32 accumulation, also for bf16 and fp16 inputs) and consumed by vpce's kernels
// while the tile is in cache. Extra memory is O(N) plus the tiles (see HeadOptions).
//
// Two modes:
//  - recompute (the default): linear_cross_entropy_forward keeps each tile's statistics and
//    lets the tile go (one all-gather per call); linear_cross_entropy_backward recomputes
//    the tiles to produce the gradients (no collective). Four GEMMs in all.
//  - chunked: when the upstream gradient of a reduced (sum or mean) loss is known at forward
//    time, linear_cross_entropy_forward_backward finishes the gradients inside the forward,
//    chunk of tokens by chunk (three GEMMs; one all-gather per chunk).
//
// Gradients. grad_hidden is this rank's part, sum_v dx_iv W_r[v]: the group's sum of the
// parts is the gradient of h (Megatron all-reduces it in the backward, or reduce-scatters
// it with sequence parallelism); all_reduce_hidden_gradient does that sum through a
// Communicator, in rank order, bit-identical on every rank. grad_weight [V_r, H] and
// grad_bias [V_r] are this rank's own and complete. Each is either written over (fp32 or
// the input's dtype) or added into an fp32 buffer (accumulate, as Megatron's gradient-
// accumulation fusion adds into main_grad).
//
// Determinism: the tiles are cut at fixed offsets, each tile's GEMMs run on one thread and
// every sum across tiles runs in a fixed order, so results are bit-identical run to run
// and for any num_threads.
//
// Staged, for frameworks with their own collective: linear_cross_entropy_local_stats gives
// this rank's [N, 4] (or [N, 6]) statistics; gather them, then merge_stats (with every
// rank's VocabShard when label smoothing is on) and calculate_loss (vpce/loss.h) as for
// logits, then linear_cross_entropy_backward.
//
// Every function validates all of its arguments first and returns kInvalidArgument naming
// the argument, the expected and the actual value; on any error no output is written.
#pragma once

#include <cstdint>

#include "vpce/communicator.h"
#include "vpce/options.h"
#include "vpce/status.h"
#include "vpce/tensor.h"
#include "vpce/workspace.h"

namespace vpce {

// The output layer's operands on this rank. hidden [..., H] (the leading dimensions are
// the N tokens, collapsing to one row stride >= H), weight [V_r, H] (rows strided, H
// contiguous) and bias [V_r] (any stride), all of one dtype: float32, bfloat16 or float16.
struct HeadInputs {
  TensorView hidden;
  TensorView weight;
  const TensorView* bias = nullptr;
};

// One gradient output: null for not wanted; written over (float32 or the input's dtype),
// or, with accumulate, added into (float32 only).
struct GradientOutput {
  const TensorView* tensor = nullptr;
  bool accumulate = false;
};

// The backward's outputs, each of its input's shape. Any may be left out.
struct HeadGradients {
  GradientOutput hidden;  // [..., H] like hidden: this rank's part (see the top)
  GradientOutput weight;  // [V_r, H]
  GradientOutput bias;    // [V_r]; only with a bias
};

// Tile and chunk sizes (0 picks the default), and the gradients' precision. Results depend
// on them (a different tile cut is a different order of fp32 sums), never on the thread
// count.
struct HeadOptions {
  // Tokens per tile (default 512) and vocabulary rows per tile (default 1024, at most V_r);
  // the backward also holds an fp32 [N, vocab_block] buffer of logit gradients.
  int64_t token_block = 0;
  int64_t vocab_block = 0;
  // Chunked mode: tokens per chunk (default: the largest multiple of token_block whose
  // [chunk, ceil(V / R)] fp32 logits fit in 128 MiB, at least one block: the same on every
  // rank, uneven ranges included). Every rank must pass the same value, as for the options,
  // and in this mode the same token_block too (the chunk is a multiple of it; ranks that
  // differ fail alike on the size of their gathers).
  int64_t chunk_tokens = 0;
  // bf16 operands only (kInvalidArgument otherwise): the logit gradients dx, fp32 by
  // default, are rounded to bf16 once (to nearest even) and every gradient (hidden, weight,
  // bias) is computed from the rounded values, as PyTorch's, Liger's and Megatron's bf16 paths
  // do. Their GEMMs then run on bf16 dot products where the CPU has them (AVX512-BF16; on
  // CUDA one tensor-core GEMM instead of the two of dx's exact split): about a third less
  // time for a step (docs/performance.md). The loss, lse and extras do not change (the logits
  // stay fp32). The gradients then carry dx's rounding: each term of their sums is off by
  // at most 2^-8 of itself, against fp32's rounding of dx by default (where dx is below
  // 2^-126, bf16's subnormals, AVX512-BF16's dot products flush it to zero: an error below
  // 2^-126 |w| per term). Ranks may differ in it: each rank's gradients then carry its own
  // choice's rounding.
  bool bf16_logit_gradients = false;
  // bf16 and fp16 operands: the logits rounded to the operands' dtype before the loss, as a
  // bf16 or fp16 output layer returns them (torch.matmul, then + bias: z = round(round(h W^T) +
  // b)), so that the loss and its logit gradients are those of a framework's bf16 or fp16 run
  // (Megatron's) up to the GEMMs' order of summation; the gradient passes through the
  // rounding unchanged, as theirs does. Off by default: fp32 logits, the more exact. No
  // effect on fp32 operands. Every rank must pass the same value (the forward checks it).
  bool round_logits = false;
};

// ---- recompute mode ---------------------------------------------------------------------

// Forward: the loss of x = h W_r^T + b_r, exactly as vpce::forward of those logits (one
// all_gather through `comm`, the group's agreement checked, the same outputs: loss, lse to
// keep for the backward (float64, or float32: vpce/loss.h), the extras). Every rank also checks that the group agrees
// on H and the dtype. `workspace` may be null; one kept between the steps holds the tiles' buffers (and the backward's
// logit gradients, the chunked mode's chunk of logits), so that a step that finds it large enough neither allocates nor
// faults in fresh pages.
Status linear_cross_entropy_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                    const VocabShard& shard, const LossOptions& options, const HeadOptions& head,
                                    const TensorView& loss, const TensorView& lse, const ForwardExtras& extras = {},
                                    Workspace* workspace = nullptr);

// Backward: no collective. Recomputes the logit tiles from the same inputs, takes the lse
// of the forward, the upstream gradient grad_loss (float32: one per token for kNone, one
// element otherwise) and the weights given to the forward, if any, and writes or adds the
// gradients asked for. The outputs must not overlap each other or the inputs.
Status linear_cross_entropy_backward(const HeadInputs& inputs, const TensorView& targets, const TensorView& lse,
                                     const TensorView& grad_loss, const VocabShard& shard, const LossOptions& options,
                                     const HeadOptions& head, const HeadGradients& gradients,
                                     const TensorView* weights = nullptr, Workspace* workspace = nullptr);

// ---- chunked mode -----------------------------------------------------------------------

// Forward and backward at once, for a reduced loss (options.reduction kSum or kMean) whose
// upstream gradient `grad_loss` (a float) is known now (1 for loss.backward()). The loss,
// lse and extras are the forward's, bit for bit; the gradients are the backward's with
// that upstream gradient (their fp32 sums run in another order, so not bit for bit).
// Collective: one all_gather per chunk of head.chunk_tokens tokens; `collectives`, when
// not null, gets the number made, also when the call fails (a rank with a bad argument
// still joins the first gather, so that every rank returns the error: 1). Bad arguments
// and ranks that disagree are found at the first chunk, before anything is written; a
// communication failure at a later chunk (a transport error or a timeout) returns its
// error with the earlier chunks' gradients already written or, with `accumulate`, already
// added: the buffers then hold part of the step, so a caller must not retry the step on
// them (restore them, or restart from the checkpoint).
Status linear_cross_entropy_forward_backward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                             const VocabShard& shard, const LossOptions& options,
                                             const HeadOptions& head, float grad_loss, const TensorView& loss,
                                             const TensorView& lse, const HeadGradients& gradients,
                                             const ForwardExtras& extras = {}, Workspace* workspace = nullptr,
                                             int64_t* collectives = nullptr);

// ---- staged, and the hidden gradient's reduction ---------------------------------------

// This rank's statistics of its logits x, float32 [N, 4] ([N, 6] with the extras), as
// calculate_local_stats (vpce/loss.h) would give for x. No communication.
Status linear_cross_entropy_local_stats(const HeadInputs& inputs, const TensorView& targets, const VocabShard& shard,
                                        const LossOptions& options, const HeadOptions& head, const TensorView& stats);

// Collective: grad_hidden (float32 [..., H], this rank's part) <- the sum of every rank's
// part, added in rank order in fp32 so that every rank gets the same bits. Runs through
// comm.all_gather in pieces of at most 64 MiB per rank; the ranks must agree on the shape.
Status all_reduce_hidden_gradient(Communicator& comm, const TensorView& grad_hidden);

}  // namespace vpce
