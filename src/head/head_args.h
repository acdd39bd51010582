// head/head_args.h: the fused head's validated operands, as plain matrices and vectors for
// the tile sweeps (tiles.h), and the checks that produce them.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "../protocol.h"
#include "../validate.h"
#include "vpce/head.h"

namespace vpce::detail {

// Tile sizes resolved from HeadOptions for V_r vocabulary rows.
struct HeadTiles {
  int64_t token_block = 0;  // Nb
  int64_t vocab_block = 0;  // Vb
};

struct HeadArgs {
  RowMatrix hidden;  // [N, H]
  RowMatrix weight;  // [V_r, H], the same dtype
  TokenVector bias;  // [V_r]; its base is null for an empty range even when given
  bool has_bias = false;
  TokenVector targets;  // [N]
  TokenVector weights;  // [N] token weights, or absent
  uint64_t inputs_hash = 0;
  HeadTiles tiles;
  bool bf16_logit_gradients = false;  // HeadOptions' (bf16 operands only)
  bool round_logits = false;          // HeadOptions' (bf16 and fp16 operands; false for fp32)
  int64_t tokens() const { return hidden.rows; }
  int64_t hidden_size() const { return hidden.cols; }
  int64_t vocab_rows() const { return weight.rows; }
};

// One gradient output: matrix (or vector, as a one-column matrix) absent when base is null.
struct GradientArgs {
  RowMatrix matrix;
  bool accumulate = false;
  bool present() const { return matrix.base != nullptr; }
};

struct HeadGradientArgs {
  GradientArgs hidden;  // [N, H]
  GradientArgs weight;  // [V_r, H]
  GradientArgs bias;    // [V_r, 1], rows bias stride apart
};

// hidden, weight and bias (CPU), the targets and token weights (values checked, hashed),
// the shard, the options and the tile sizes.
Status check_head_inputs(const HeadInputs& inputs, const TensorView& targets, const TensorView* weights,
                         const VocabShard& shard, const LossOptions& options, const HeadOptions& head, HeadArgs* out);

// ceil(V / ranks) (at least 1): the vocabulary rows per rank that every rank agrees on, which
// the chunked mode's default chunk (CPU and CUDA) is sized for.
int64_t agreed_vocab_rows(const VocabShard& shard, int ranks);

// The chunked mode's tokens per chunk: head.chunk_tokens, or by default the largest multiple
// of the token block whose [chunk, ceil(V / ranks)] fp32 logits fit in 128 MiB. It depends only
// on what the group agrees on (V, the rank count and the options), not on this rank's range or
// on whether its arguments passed, so every rank makes gathers of the same sizes.
int64_t agreed_chunk_tokens(const HeadOptions& head, const VocabShard& shard, int ranks);

// The head's block of each gather's header (protocol.h): its mode, the hidden size H, and
// in the chunked mode all its tokens (each gather carries a chunk's) and its upstream
// gradient, bit for bit (0 in the recompute mode).
OperationBlock head_operation(int64_t hidden_size, bool chunked, int64_t head_tokens, float grad_loss,
                              bool round_logits);

// The regions of hidden, weight, bias, targets and token weights.
std::vector<NamedRegion> input_regions(const HeadArgs& args);

// The gradients asked for: each of its input's shape, float32 or the input's dtype when
// written over, float32 when added into; overlapping neither each other nor `inputs`.
Status check_head_gradients(const HeadGradients& gradients, const HeadArgs& args,
                            const std::vector<NamedRegion>& inputs, HeadGradientArgs* out);
// The same rules for any device: check_place(tensor, name) checks where a gradient lives (the
// CPU above; hidden's CUDA device, as device memory, on the device path).
Status check_head_gradients(const HeadGradients& gradients, const HeadArgs& args,
                            const std::vector<NamedRegion>& inputs,
                            const std::function<Status(const TensorView&, const char*)>& check_place,
                            HeadGradientArgs* out);

}  // namespace vpce::detail
