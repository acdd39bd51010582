// tools/run_io.h: what both backends of `vpce run` share: reading and checking the input
// files, converting logits to the compute dtype, splitting the vocabulary, and writing the
// outputs with the one-line summary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "commands.h"
#include "npy.h"
#include "vpce/vpce.h"

namespace vpce::tools {

// The logits file's header, checked: float32 or float16, shape [..., V] with V >= 1.
Status read_logits_info(const RunConfig& config, npy::Info* info);

// What a run on these logits holds in memory, for an out-of-memory message:
// "L.npy ([4096, 32000] float32 logits; about 1.5 GiB in all)".
std::string memory_needed(const RunConfig& config, const npy::Info& info);

// Targets, and the optional upstream gradient and weights, checked against the logits'
// leading shape.
struct TokenInputs {
  npy::Array targets, grad_output, weights;
};
Status read_token_inputs(const RunConfig& config, const std::vector<int64_t>& leading, TokenInputs* in);

// Logits converted to the compute dtype (--dtype, or the file's own).
struct ComputeBuffer {
  DataType dtype = kFloat32;
  std::vector<std::byte> bytes;
  std::byte* data() { return bytes.data(); }
};
Status make_compute_buffer(const npy::Array& logits, const std::string& dtype, ComputeBuffer* out);

// The shards of --vocab-splits, or an even split of V over `ranks`.
Status vocab_ranges(const RunConfig& config, int ranks, int64_t vocab, std::vector<VocabShard>* out);

// One rank's forward outputs.
struct RankOutputs {
  std::vector<float> loss, target_is_argmax, entropy;
  std::vector<double> lse;  // float64: the backward's gradient exact at any |lse|
};
RankOutputs make_rank_outputs(const RunConfig& config, int64_t tokens);

// Views of one rank's outputs for forward(), and the ForwardExtras pointing into them
// (with the weights when given, the extras when config.extras). Not copyable: `extras`
// points into the object.
struct ForwardOutputs {
  ForwardOutputs(const RunConfig& config, RankOutputs& out, int64_t tokens, const TensorView* weights);
  ForwardOutputs(const ForwardOutputs&) = delete;
  ForwardOutputs& operator=(const ForwardOutputs&) = delete;

  TensorView loss, lse, target_is_argmax, entropy;
  ForwardExtras extras;
};

// Writes loss.npy, lse.npy, grad_logits.npy (float32 [..., V]) and the extras into
// config.out_dir and prints the summary line:
//   vpce run: tokens N  V V  <head>  <loss label> <value>  <tail>
Status write_outputs(const RunConfig& config, const std::vector<int64_t>& logits_shape, const RankOutputs& outputs,
                     const float* grad, const std::string& summary_head, const std::string& summary_tail);

}  // namespace vpce::tools
