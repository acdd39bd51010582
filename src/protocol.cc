// protocol.cc: the header each rank sends in the forward, and the group's agreement check.
#include "protocol.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/partition.h"
#include "common/text.h"

namespace vpce::detail {
namespace {

uint32_t dtype_word(DataType d) {
  return static_cast<uint32_t>(d.code) | static_cast<uint32_t>(d.bits) << 8 | static_cast<uint32_t>(d.lanes) << 16;
}

std::string dtype_text(uint32_t word) {
  return to_string(DataType{static_cast<TypeCode>(word & 0xff), static_cast<uint8_t>((word >> 8) & 0xff),
                            static_cast<uint16_t>(word >> 16)});
}

Status disagree(const char* what, int rank_a, const std::string& a, int rank_b, const std::string& b) {
  return {Code::kInvalidUsage, "ranks disagree on " + std::string(what) + ": expected rank " + std::to_string(rank_a) +
                                   "'s " + a + " on every rank, got " + b + " on rank " + std::to_string(rank_b)};
}

RankHeader read_header(const char* gathered, std::size_t stride, int r) {
  RankHeader h;
  std::memcpy(&h, gathered + static_cast<std::size_t>(r) * stride, sizeof(h));
  h.message[sizeof(h.message) - 1] = '\0';
  return h;
}

// The vocabulary ranges, sorted by start, must tile [0, V) with no gap or overlap.
Status check_partition(const std::vector<RankHeader>& headers) {
  std::vector<OwnedRange> ranges;
  for (const RankHeader& h : headers) ranges.push_back({h.vocab_begin, h.vocab_end, h.rank});  // (ranks checked before)
  const int64_t vocab = headers[0].vocab_size;
  const std::optional<PartitionFault> fault = partition_fault(std::move(ranges), vocab);
  if (!fault) return {};
  const std::string head =
      "vocabulary ranges do not partition [0, " + std::to_string(vocab) + "): expected ranges that tile it, got ";
  if (fault->kind == PartitionFault::Kind::kOverlap) {
    const auto range = [](const OwnedRange& r) {
      return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
    };
    return {Code::kInvalidUsage, head + "rank " + std::to_string(fault->previous->rank) + " " +
                                     range(*fault->previous) + " and rank " + std::to_string(fault->first->rank) + " " +
                                     range(*fault->first) + " overlapping"};
  }
  const int64_t unowned_end = fault->first ? fault->first->begin : vocab;
  return {Code::kInvalidUsage, head + "columns [" + std::to_string(fault->covered) + ", " +
                                   std::to_string(unowned_end) + ") owned by no rank"};
}

// `text` into `out` (of `size` bytes), truncated, NUL-terminated.
void copy_text(char* out, std::size_t size, const std::string& text) {
  std::memcpy(out, text.data(), std::min(text.size(), size - 1));
}

// The block's text fields as read from another rank: NUL-terminated whatever it sent.
std::string text_of(const char* field, std::size_t size) { return std::string(field, strnlen(field, size)); }

std::string operation_text(const OperationBlock& o) {
  return text_of(o.name, sizeof(o.name)) + ", " + text_of(o.mode, sizeof(o.mode));
}

// Which operation, and in which mode, then the operation's own values.
Status check_operation(const RankHeader& first, const RankHeader& h) {
  const OperationBlock& a = first.operation;
  const OperationBlock& b = h.operation;
  const std::string name = text_of(a.name, sizeof(a.name));
  if (name != text_of(b.name, sizeof(b.name))) {
    return disagree("the operation", 0, operation_text(a), h.rank, operation_text(b));
  }
  const std::string mode = text_of(a.mode, sizeof(a.mode));
  if (mode != text_of(b.mode, sizeof(b.mode))) {
    return disagree(("the " + name + "'s mode").c_str(), 0, mode, h.rank, text_of(b.mode, sizeof(b.mode)));
  }
  for (int k = 0; k < OperationBlock::kValues; ++k) {
    if (a.values[k] == b.values[k]) continue;
    const bool is_float = (a.float_values >> k & 1U) != 0;
    auto text = [&](int64_t v) {
      return is_float ? number_text(std::bit_cast<float>(static_cast<uint32_t>(v))) : std::to_string(v);
    };
    return disagree(text_of(a.labels[k], OperationBlock::kLabelBytes).c_str(), 0, text(a.values[k]), h.rank,
                    text(b.values[k]));
  }
  return {};
}

}  // namespace

OperationBlock operation_block(const char* name, const char* mode, std::initializer_list<OperationValue> values) {
  OperationBlock o;
  copy_text(o.name, sizeof(o.name), name);
  copy_text(o.mode, sizeof(o.mode), mode);
  int k = 0;
  for (const OperationValue& v : values) {
    if (k == OperationBlock::kValues) break;  // (an operation's code declares at most kValues)
    o.values[k] = v.value;
    copy_text(o.labels[k], OperationBlock::kLabelBytes, v.label);
    if (v.is_float) o.float_values |= 1U << k;
    ++k;
  }
  return o;
}

namespace {

// An option's bits as the ranks compare them: -0 as 0 (the same option, which a rank may
// spell either way).
uint32_t agreed_bits(float value) { return std::bit_cast<uint32_t>(value == 0.0f ? 0.0f : value); }

}  // namespace

OperationValue float_value(const char* label, float value) {
  return {label, static_cast<int64_t>(agreed_bits(value)), true};
}

RankHeader make_header(int rank, int num_ranks, int64_t num_tokens, int64_t stats_width, const VocabShard& shard,
                       DataType logits_dtype, const LossOptions& options, bool has_weights, uint64_t inputs_hash,
                       const OperationBlock& operation, const Status& local) {
  RankHeader h;
  h.rank = rank;
  h.num_ranks = num_ranks;
  h.status = static_cast<int32_t>(local.code());
  h.logits_dtype = dtype_word(logits_dtype);
  h.num_tokens = num_tokens;
  h.vocab_size = shard.vocab_size;
  h.vocab_begin = shard.vocab_begin;
  h.vocab_end = shard.vocab_end;
  h.inputs_hash = inputs_hash;
  h.stats_width = stats_width;
  h.ignore_index = options.ignore_index;
  h.valid_vocab_size = options.valid_vocab_size;
  h.label_smoothing_bits = agreed_bits(options.label_smoothing);
  h.z_loss_bits = agreed_bits(options.z_loss_weight);
  h.logit_scale_bits = agreed_bits(options.logit_scale);
  h.softcap_bits = agreed_bits(options.softcap);
  h.smoothing_semantics = static_cast<int32_t>(options.smoothing_semantics);
  h.reduction = static_cast<int32_t>(options.reduction);
  h.has_weights = has_weights ? 1 : 0;
  h.operation = operation;
  copy_text(h.message, sizeof(h.message), local.message());
  return h;
}

void set_device_found_message(RankHeader& header, const VocabShard& shard, const LossOptions& options) {
  if (header.status != 0) return;
  std::snprintf(header.message, sizeof(header.message),
                "targets or weights: expected targets in [0, %lld) or %lld and finite weights >= 0, got another value "
                "(found on the device)",
                static_cast<long long>(options.valid_vocab_size > 0 ? options.valid_vocab_size : shard.vocab_size),
                static_cast<long long>(options.ignore_index));
}

void set_device_found_message(RankHeader& header, const std::string& message) {
  if (header.status != 0) return;
  std::snprintf(header.message, sizeof(header.message), "%s", message.c_str());
}

Status check_group(const char* gathered, std::size_t stride, int ranks, int self) {
  std::vector<RankHeader> headers;
  headers.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) headers.push_back(read_header(gathered, stride, r));

  for (int r = 0; r < ranks; ++r) {
    const RankHeader& h = headers[static_cast<std::size_t>(r)];
    if (h.magic != RankHeader::kMagic || h.version != RankHeader::kVersion || h.rank != r || h.num_ranks != ranks) {
      return {Code::kInvalidUsage, "all_gather: expected a vpce forward header (version " +
                                       std::to_string(RankHeader::kVersion) + ", rank " + std::to_string(r) + " of " +
                                       std::to_string(ranks) + ") from rank " + std::to_string(r) +
                                       ", got something else: is another collective running on the same communicator?"};
    }
  }
  for (int r = 0; r < ranks; ++r) {
    const RankHeader& h = headers[static_cast<std::size_t>(r)];
    if (h.status != 0) {
      const Code code = r == self ? static_cast<Code>(h.status) : Code::kRemoteError;
      return {code, "rank " + std::to_string(r) + " of " + std::to_string(ranks) + ": " +
                        code_name(static_cast<Code>(h.status)) + ": " + h.message};
    }
  }
  const RankHeader& first = headers[0];
  for (int r = 1; r < ranks; ++r) {
    const RankHeader& h = headers[static_cast<std::size_t>(r)];
    // What was called first (which operation, its mode and its own values): the token counts
    // of the head's modes differ (a chunk's or all of them).
    if (Status s = check_operation(first, h); !s.ok()) return s;
    if (h.num_tokens != first.num_tokens) {
      return disagree("the number of tokens", 0, std::to_string(first.num_tokens), r, std::to_string(h.num_tokens));
    }
    if (h.vocab_size != first.vocab_size) {
      return disagree("the vocabulary size", 0, std::to_string(first.vocab_size), r, std::to_string(h.vocab_size));
    }
    if (h.logits_dtype != first.logits_dtype) {
      return disagree("the logits' dtype", 0, dtype_text(first.logits_dtype), r, dtype_text(h.logits_dtype));
    }
    const struct {
      const char* what;
      int64_t mine;
      int64_t theirs;
      bool is_float;
    } options[] = {
        {"options.label_smoothing", first.label_smoothing_bits, h.label_smoothing_bits, true},
        {"options.smoothing_semantics", first.smoothing_semantics, h.smoothing_semantics, false},
        {"options.ignore_index", first.ignore_index, h.ignore_index, false},
        {"options.z_loss_weight", first.z_loss_bits, h.z_loss_bits, true},
        {"options.logit_scale", first.logit_scale_bits, h.logit_scale_bits, true},
        {"options.softcap", first.softcap_bits, h.softcap_bits, true},
        {"options.valid_vocab_size", first.valid_vocab_size, h.valid_vocab_size, false},
        {"options.reduction", first.reduction, h.reduction, false},
        {"whether weights are given", first.has_weights, h.has_weights, false},
        {"which extras are computed (stats per token)", first.stats_width, h.stats_width, false},
    };
    for (const auto& o : options) {
      if (o.mine == o.theirs) continue;
      auto text = [&](int64_t v) {
        return o.is_float ? number_text(std::bit_cast<float>(static_cast<uint32_t>(v))) : std::to_string(v);
      };
      return disagree(o.what, 0, text(o.mine), r, text(o.theirs));
    }
    if (h.inputs_hash != first.inputs_hash) {
      return disagree("the targets, weights or temperatures", 0, "values", r, "other values (their hashes differ)");
    }
  }
  return check_partition(headers);
}

}  // namespace vpce::detail
