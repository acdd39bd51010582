// protocol.h: what each rank sends in the forward's one all-gather.
//
// Rank r sends a fixed 384-byte RankHeader followed by its [N, 4] TokenStats. The header
// carries the rank's view of the call (tokens, V, its vocabulary range, dtype, options, a
// hash of the targets) and, if its own arguments were bad, its error message. After the
// gather every rank runs the same check_group() on the same bytes, so either all ranks
// proceed or all return the same error, and no rank waits for another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "vpce/loss.h"
#include "vpce/status.h"

namespace vpce::detail {

struct RankHeader {
  static constexpr uint32_t kMagic = 0x45435056;  // "VPCE"
  // 5: half the logits' mean relative to the max; 6: the chunked head's tokens and grad_loss
  static constexpr uint32_t kVersion = 6;

  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  int32_t rank = 0;
  int32_t num_ranks = 0;
  int32_t status = 0;         // Code of this rank's own argument check; 0 when fine
  uint32_t logits_dtype = 0;  // code | bits << 8 | lanes << 16
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
  uint8_t head_chunked = 0;  // 1: the fused head's chunked mode (a gather per chunk)
  char padding[6] = {};
  int64_t hidden_size = 0;  // H of the fused head (vpce/head.h); 0 for a forward of logits
  // The fused head's chunked mode: all its tokens (each gather carries a chunk's) and its
  // upstream gradient, bit for bit (0 otherwise).
  int64_t head_tokens = 0;
  uint32_t head_grad_loss_bits = 0;
  char padding_after_grad_loss[4] = {};
  char message[239] = {};  // this rank's error, truncated, NUL-terminated
};
static_assert(sizeof(RankHeader) == 384);

// Bytes one rank sends for n tokens of `width` floats each.
inline std::size_t payload_bytes(int64_t n, int64_t width) {
  return sizeof(RankHeader) + static_cast<std::size_t>(n * width) * sizeof(float);
}

// Fills a header for this rank; `local` is the rank's own argument check. The fused head
// sets hidden_size afterwards (logits_dtype then holds the dtype of its operands).
RankHeader make_header(int rank, int num_ranks, int64_t num_tokens, int64_t stats_width,
                       const VocabShard& shard, DataType logits_dtype, const LossOptions& options,
                       bool has_weights, uint64_t inputs_hash, const Status& local);

// Checks the gathered headers (`ranks` of them, `stride` bytes apart) for agreement and
// returns the same Status on every rank that sees the same bytes. `self` is the calling
// rank, which returns its own error code where it was the one that failed.
Status check_group(const char* gathered, std::size_t stride, int ranks, int self);

}  // namespace vpce::detail
