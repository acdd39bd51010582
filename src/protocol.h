// protocol.h: what each rank sends in the forward's one all-gather.
//
// Rank r sends a fixed 832-byte RankHeader followed by its [N, 4] TokenStats. The header
// carries the rank's view of the call (tokens, V, its vocabulary range, dtype, options, a
// hash of the targets, the operation's own block) and, if its own arguments were bad, its
// error message. After the
// gather every rank runs the same check_group() on the same bytes, so either all ranks
// proceed or all return the same error, and no rank waits for another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "vpce/options.h"
#include "vpce/status.h"

namespace vpce::detail {

// The operation a gather belongs to, filled by the operation (its own folder of src/) and
// compared by the engine without knowing it: its name and mode (together they identify it;
// ranks in different operations or modes are told so first), and up to kValues values the
// ranks must agree on beyond the engine's fields, each compared bit for bit and named by its
// label in the error (a value whose bit is set in float_values prints as an fp32 number).
struct OperationBlock {
  static constexpr int kValues = 6;
  static constexpr std::size_t kLabelBytes = 56;
  char name[24] = {};  // "fused head": a disagreement on the mode reads "the fused head's mode"
  char mode[48] = {};  // "recompute (linear_cross_entropy_forward)"
  int64_t values[kValues] = {};
  char labels[kValues][kLabelBytes] = {};  // "the hidden size of the fused head"; empty: unused
  uint32_t float_values = 0;
  char padding[4] = {};
};
static_assert(sizeof(OperationBlock) == 464);

// An operation's block: `name` and `mode` as above, then each value with its label.
struct OperationValue {
  const char* label;
  int64_t value;
  bool is_float = false;  // value holds an fp32's bits
};
OperationBlock operation_block(const char* name, const char* mode, std::initializer_list<OperationValue> values = {});
// The fp32 `value` as an OperationValue's bits.
OperationValue float_value(const char* label, float value);

struct RankHeader {
  static constexpr uint32_t kMagic = 0x45435056;  // "VPCE"
  // 5: half the logits' mean relative to the max; 6: the chunked head's tokens and grad_loss;
  // 7: the operation's block instead of the head's fields; 8: six values in that block
  static constexpr uint32_t kVersion = 8;

  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  int32_t rank = 0;
  int32_t num_ranks = 0;
  int32_t status = 0;         // Code of this rank's own argument check; 0 when fine
  uint32_t logits_dtype = 0;  // code | bits << 8 | lanes << 16 (the fused head: its operands')
  int64_t num_tokens = 0;
  int64_t vocab_size = 0;
  int64_t vocab_begin = 0;
  int64_t vocab_end = 0;
  uint64_t inputs_hash = 0;  // of the targets' and weights' values
  int64_t stats_width = 0;   // floats per token: 4, or 6 with the extras
  // The options, bit for bit.
  int64_t ignore_index = 0;
  int64_t valid_vocab_size = 0;
  uint32_t label_smoothing_bits = 0;
  uint32_t z_loss_bits = 0;
  uint32_t logit_scale_bits = 0;
  uint32_t softcap_bits = 0;
  int32_t smoothing_semantics = 0;
  int32_t reduction = 0;
  uint8_t has_weights = 0;
  char padding[7] = {};
  OperationBlock operation;
  char message[248] = {};  // this rank's error, truncated, NUL-terminated
};
static_assert(sizeof(RankHeader) == 832);

// Bytes one rank sends for n tokens of `width` floats each.
inline std::size_t payload_bytes(int64_t n, int64_t width) {
  return sizeof(RankHeader) + static_cast<std::size_t>(n * width) * sizeof(float);
}

// Fills a header for this rank; `local` is the rank's own argument check.
RankHeader make_header(int rank, int num_ranks, int64_t num_tokens, int64_t stats_width, const VocabShard& shard,
                       DataType logits_dtype, const LossOptions& options, bool has_weights, uint64_t inputs_hash,
                       const OperationBlock& operation, const Status& local);

// For a forward on device tensors, whose targets and weights are checked on the device: the
// message the header carries (while its status is still 0) for the device to report, through
// that status, if it finds a bad value. A header whose rank's own check failed keeps its error.
void set_device_found_message(RankHeader& header, const VocabShard& shard, const LossOptions& options);
// The same with an operation's own message (truncated to the header's).
void set_device_found_message(RankHeader& header, const std::string& message);

// Checks the gathered headers (`ranks` of them, `stride` bytes apart) for agreement and
// returns the same Status on every rank that sees the same bytes. `self` is the calling
// rank, which returns its own error code where it was the one that failed.
Status check_group(const char* gathered, std::size_t stride, int ranks, int self);

}  // namespace vpce::detail
