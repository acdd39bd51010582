// loss/loss.cc: the staged API (local stats, merge, loss, gradient) and the backward.
//
// Each entry validates every argument, then runs its kernel; on any error it returns
// before writing anything.
#include <string>
#include <utility>
#include <limits>
#include <vector>

#include "common/partition.h"
#include "cpu/kernels.h"
#include "cuda/dispatch.h"
#include "validate.h"
#include "vpce/loss.h"

namespace vpce {

using detail::LossInputs;
using detail::RowMatrix;
using detail::TokenVector;

namespace {

Status overlap_error(const char* output, const char* input) {
  return {Code::kInvalidArgument,
          detail::expected_got(output, std::string("memory that does not overlap ") + input, "an overlapping buffer")};
}

bool overlaps(const TokenVector& a, const char* begin, const char* end) {
  return detail::overlaps(a.base, a.end_byte(), begin, end);
}

// A stats tensor: float32 [rows, 4] or [rows, 6]; rows = its first dimension.
Status as_any_stats(const TensorView& t, const char* name, RowMatrix* out) {
  if (t.ndim != 2) {
    return {Code::kInvalidArgument, detail::expected_got((std::string(name) + ".ndim").c_str(), "2 ([tokens, 4 or 6])",
                                                         std::to_string(t.ndim))};
  }
  const int64_t width = t.shape[1] == kStatsWidthWithExtras ? kStatsWidthWithExtras : kStatsWidth;
  return detail::as_stats_matrix(t, name, t.shape[0], width, out);
}

// The staged API runs on the CPU in this release; device tensors go through forward() and
// backward().
Status host_only(const TensorView& t, const char* name, const char* call) {
  if (t.device.type == DeviceType::kCPU) return {};
  return {Code::kUnsupported, detail::expected_got((std::string(name) + ".device").c_str(),
                                                   std::string("cpu (") + call +
                                                       " runs on the CPU; device tensors use forward and backward)",
                                                   to_string(t.device))};
}

}  // namespace

Status calculate_local_stats(const TensorView& logits, const TensorView& targets, const VocabShard& shard,
                             const LossOptions& options, const TensorView& stats) {
  if (Status s = host_only(logits, "logits", "calculate_local_stats"); !s.ok()) return s;
  if (Status s = host_only(stats, "stats", "calculate_local_stats"); !s.ok()) return s;
  if (Status s = detail::check_not_legacy_smoothing(options, "calculate_local_stats"); !s.ok()) return s;
  LossInputs in;
  if (Status s = detail::check_loss_inputs(logits, targets, nullptr, shard, options, &in); !s.ok()) {
    return s;
  }
  RowMatrix out;
  if (Status s = as_any_stats(stats, "stats", &out); !s.ok()) return s;
  if (out.rows != in.logits.rows) {
    return {Code::kInvalidArgument,
            detail::expected_got("stats.shape[0]", std::to_string(in.logits.rows) + " (one stats row per token)",
                                 std::to_string(out.rows))};
  }
  if (detail::overlaps(out.begin_byte(), out.end_byte(), in.logits.begin_byte(), in.logits.end_byte())) {
    return overlap_error("stats", "the logits");
  }
  if (overlaps(in.targets, out.begin_byte(), out.end_byte())) return overlap_error("stats", "the targets");
  detail::local_stats_kernel(in.logits, in.targets, shard.vocab_begin, detail::loss_params(options, shard),
                             options.num_threads, out);
  return {};
}

namespace {

// The valid columns of each rank's shard (into `columns`), after checking that the shards
// partition [0, vocab_size), one per rank.
Status shard_columns(std::span<const VocabShard> shards, int64_t ranks, const LossOptions& options,
                     std::vector<int64_t>* columns) {
  if (static_cast<int64_t>(shards.size()) != ranks) {
    return {
        Code::kInvalidArgument,
        detail::expected_got("shards", "one VocabShard per rank (gathered.shape[0] = " + std::to_string(ranks) + ")",
                             std::to_string(shards.size()) + " shards")};
  }
  const int64_t vocab_size = shards[0].vocab_size;
  std::vector<detail::OwnedRange> ranges;
  for (std::size_t r = 0; r < shards.size(); ++r) {
    const VocabShard& shard = shards[r];
    const std::string name = "shards[" + std::to_string(r) + "]";
    if (shard.vocab_size != vocab_size || vocab_size < 1) {
      return {Code::kInvalidArgument,
              detail::expected_got((name + ".vocab_size").c_str(),
                                   ">= 1 and the same on every shard (shards[0]'s " + std::to_string(vocab_size) + ")",
                                   std::to_string(shard.vocab_size))};
    }
    if (shard.vocab_begin < 0 || shard.vocab_begin > shard.vocab_end || shard.vocab_end > vocab_size) {
      return {Code::kInvalidArgument,
              detail::expected_got((name + ".vocab_begin, .vocab_end").c_str(),
                                   "0 <= begin <= end <= vocab_size (" + std::to_string(vocab_size) + ")",
                                   std::to_string(shard.vocab_begin) + ", " + std::to_string(shard.vocab_end))};
    }
    ranges.push_back({shard.vocab_begin, shard.vocab_end, static_cast<int>(r)});
  }
  if (const auto fault = detail::partition_fault(std::move(ranges), vocab_size)) {
    const bool overlap = fault->kind == detail::PartitionFault::Kind::kOverlap;
    return {Code::kInvalidArgument,
            detail::expected_got("shards", "ranges that partition [0, " + std::to_string(vocab_size) + ")",
                                 (overlap ? "an overlap at column " : "a gap at column ") +
                                     std::to_string(overlap ? fault->first->begin : fault->covered))};
  }
  const detail::LossParams params = detail::loss_params(options, VocabShard{0, vocab_size, vocab_size});
  columns->clear();
  for (const VocabShard& shard : shards) {
    columns->push_back(detail::valid_columns(shard.vocab_begin, shard.vocab_end - shard.vocab_begin, params));
  }
  return {};
}

}  // namespace

Status merge_stats(const TensorView& gathered, const LossOptions& options, const TensorView& stats) {
  return merge_stats(gathered, options, stats, {});
}

Status merge_stats(const TensorView& gathered, const LossOptions& options, const TensorView& stats,
                   std::span<const VocabShard> shards) {
  if (Status s = host_only(gathered, "gathered", "merge_stats"); !s.ok()) return s;
  if (Status s = host_only(stats, "stats", "merge_stats"); !s.ok()) return s;
  if (Status s = detail::check_not_legacy_smoothing(options, "merge_stats"); !s.ok()) return s;
  if (Status s = detail::check_dtype("gathered", gathered.dtype, {kFloat32}, "float32"); !s.ok()) {
    return s;
  }
  if (gathered.ndim != 3) {
    return {Code::kInvalidArgument,
            detail::expected_got("gathered.ndim", "3 ([ranks, tokens, 4 or 6])", std::to_string(gathered.ndim))};
  }
  const int64_t ranks = gathered.shape[0];
  if (ranks < 1 || ranks > (1 << 20)) {
    return {Code::kInvalidArgument,
            detail::expected_got("gathered.shape[0]", "a number of ranks in [1, 2^20]", std::to_string(ranks))};
  }
  // The options as the other stages check them; the vocabulary is the shards' when given
  // (without them the merge cannot know it: valid_vocab_size is checked at calculate_loss).
  const int64_t vocab = shards.empty() ? std::numeric_limits<int64_t>::max() : shards.front().vocab_size;
  if (Status s = detail::check_options(options, VocabShard{0, vocab, vocab}); !s.ok()) return s;
  // Rank r's [N, W] block is itself a stats matrix; check the first and the stride to the rest.
  TensorView block = gathered;
  block.ndim = 2;
  block.shape = {gathered.shape[1], gathered.shape[2]};
  block.strides = {gathered.strides[1], gathered.strides[2]};
  RowMatrix first;
  if (Status s = as_any_stats(block, "gathered[r]", &first); !s.ok()) return s;
  const int64_t rank_stride = gathered.strides[0];
  const int64_t block_elements = (first.end_byte() - first.begin_byte()) / 4;
  if (ranks > 1 && rank_stride < block_elements) {
    return {Code::kInvalidArgument,
            detail::expected_got("gathered.strides[0]",
                                 ">= " + std::to_string(block_elements) + " (ranks' blocks must not overlap)",
                                 std::to_string(rank_stride))};
  }
  RowMatrix out;
  if (Status s = detail::as_stats_matrix(stats, "stats", first.rows, first.cols, &out); !s.ok()) return s;
  int64_t last_block_offset = 0;  // bytes from the first rank's block to the last one's
  if (__builtin_mul_overflow(ranks - 1, rank_stride, &last_block_offset) ||
      __builtin_mul_overflow(last_block_offset, int64_t{4}, &last_block_offset) ||
      last_block_offset > (int64_t{1} << 56)) {
    return {Code::kInvalidArgument,
            detail::expected_got("gathered.strides[0]", "an extent that fits in memory", std::to_string(rank_stride))};
  }
  // An empty gathered tensor may have no data pointer (no offset may be added to null), and
  // then nothing to overlap.
  if (first.begin_byte() != nullptr) {
    const char* gathered_end = first.begin_byte() + last_block_offset + (first.end_byte() - first.begin_byte());
    if (detail::overlaps(out.begin_byte(), out.end_byte(), first.begin_byte(), gathered_end)) {
      return overlap_error("stats", "gathered");
    }
  }
  std::vector<int64_t> columns;
  if (!shards.empty()) {
    if (Status s = shard_columns(shards, ranks, options, &columns); !s.ok()) return s;
  } else if (options.label_smoothing != 0.0f && ranks > 1) {
    return {Code::kInvalidArgument,
            detail::expected_got("shards",
                                 "the " + std::to_string(ranks) +
                                     " ranks' VocabShards (with label smoothing the merge rebases each "
                                     "rank's sum of logits by its column count)",
                                 "none")};
  }
  // Without label smoothing the sums of logits are 0 and stay so.
  const bool rebase = options.label_smoothing != 0.0f && !columns.empty();
  detail::merge_stats_kernel(first.row<const float>(0), rank_stride, static_cast<int>(ranks), first.row_stride,
                             rebase ? columns.data() : nullptr, options.num_threads, out);
  return {};
}

Status calculate_loss(const TensorView& stats, const TensorView& targets, int64_t vocab_size,
                      const LossOptions& options, const TensorView& loss, const TensorView& lse,
                      const ForwardExtras& extras) {
  const std::pair<const TensorView*, const char*> views[] = {{&stats, "stats"},
                                                             {&targets, "targets"},
                                                             {&loss, "loss"},
                                                             {&lse, "lse"},
                                                             {extras.weights, "weights"},
                                                             {extras.target_is_argmax, "target_is_argmax"},
                                                             {extras.entropy, "entropy"}};
  for (const auto& [view, name] : views) {
    if (view == nullptr) continue;
    if (Status s = host_only(*view, name, "calculate_loss"); !s.ok()) return s;
  }
  if (vocab_size < 1 || vocab_size > INT32_MAX) {
    return {Code::kInvalidArgument,
            detail::expected_got("vocab_size", "a value in [1, 2^31 - 1]", std::to_string(vocab_size))};
  }
  const VocabShard whole{0, vocab_size, vocab_size};
  if (Status s = detail::check_not_legacy_smoothing(options, "calculate_loss"); !s.ok()) return s;
  if (Status s = detail::check_options(options, whole); !s.ok()) return s;
  RowMatrix in;
  if (Status s = as_any_stats(stats, "stats", &in); !s.ok()) return s;
  const int64_t n = in.rows;
  TokenVector y;
  if (Status s = detail::check_dtype("targets", targets.dtype, {kInt32, kInt64}, "int32 or int64"); !s.ok()) return s;
  if (Status s = detail::as_token_vector(targets, "targets", n, &y); !s.ok()) return s;
  const int64_t valid = options.valid_vocab_size > 0 ? options.valid_vocab_size : vocab_size;
  uint64_t hash = 0;
  if (Status s = detail::check_targets(y, valid, options.ignore_index, &hash); !s.ok()) return s;
  TokenVector weights;
  if (Status s = detail::check_weights(extras.weights, n, &weights, &hash); !s.ok()) return s;

  detail::LossOutputs out;
  if (Status s = detail::check_loss_output(loss, "loss", n, options.reduction, &out.loss); !s.ok()) return s;
  if (Status s = detail::as_lse_tokens(lse, "lse", n, &out.lse); !s.ok()) return s;
  const std::pair<const TensorView*, TokenVector*> wanted[] = {{extras.target_is_argmax, &out.target_is_argmax},
                                                               {extras.entropy, &out.entropy}};
  for (const auto& [view, vec] : wanted) {
    if (view == nullptr) continue;
    const char* name = vec == &out.entropy ? "entropy" : "target_is_argmax";
    if (in.cols != kStatsWidthWithExtras) {
      return {Code::kInvalidArgument,
              detail::expected_got("stats", std::string("6 columns (the extras) to compute ") + name,
                                   std::to_string(in.cols))};
    }
    if (Status s = detail::as_float_tokens(*view, name, n, vec); !s.ok()) return s;
  }
  const TokenVector* outputs[] = {&out.loss, &out.lse, &out.target_is_argmax, &out.entropy};
  for (int a = 0; a < 4; ++a) {
    if (!detail::present(*outputs[a])) continue;
    if (overlaps(*outputs[a], in.begin_byte(), in.end_byte()) || overlaps(*outputs[a], y.base, y.end_byte()) ||
        (detail::present(weights) && overlaps(*outputs[a], weights.base, weights.end_byte()))) {
      return overlap_error("an output", "the stats, targets or weights");
    }
    for (int b = a + 1; b < 4; ++b) {
      if (detail::present(*outputs[b]) && overlaps(*outputs[a], outputs[b]->base, outputs[b]->end_byte())) {
        return overlap_error("the outputs", "each other");
      }
    }
  }
  detail::loss_kernel(in, y, weights, detail::loss_params(options, whole), options.num_threads, out);
  return {};
}

Status backward(const TensorView& logits, const TensorView& targets, const TensorView& lse, const TensorView& grad_loss,
                const VocabShard& shard, const LossOptions& options, const TensorView& grad_logits,
                const TensorView* weights) {
  LossInputs in;
  if (Status s = detail::check_loss_inputs(logits, targets, weights, shard, options, &in); !s.ok()) return s;
  const int64_t n = in.logits.rows;
  for (const auto& [view, name] :
       {std::pair{&lse, "lse"}, std::pair{&grad_loss, "grad_loss"}, std::pair{&grad_logits, "grad_logits"}}) {
    if (Status s = detail::check_device(*view, name, logits.device); !s.ok()) return s;
  }
  TokenVector lse_in;
  TokenVector upstream;
  if (Status s = detail::as_lse_tokens(lse, "lse", n, &lse_in); !s.ok()) return s;
  if (Status s = detail::check_loss_output(grad_loss, "grad_loss", n, options.reduction, &upstream); !s.ok()) {
    return s;
  }
  RowMatrix grad;
  if (Status s = detail::check_grad_logits(
          grad_logits, in.logits,
          {detail::region_of("the targets", in.targets), detail::region_of("lse", lse_in),
           detail::region_of("grad_loss", upstream), detail::region_of("the weights", in.weights)},
          &grad);
      !s.ok()) {
    return s;
  }
  if (logits.device.type != DeviceType::kCPU) {
    const std::pair<const TensorView*, const char*> views[] = {
        {&logits, "logits"},       {&targets, "targets"},         {&lse, "lse"},
        {&grad_loss, "grad_loss"}, {&grad_logits, "grad_logits"}, {weights, "weights"}};
    for (const auto& [view, name] : views) {
      if (view == nullptr) continue;
      if (Status s = detail::check_device_pointer(*view, name); !s.ok()) return s;
    }
    return detail::device_backward({in, lse_in, upstream, grad, shard.vocab_begin, detail::loss_params(options, shard),
                                    options, logits.device.id});
  }
  detail::gradient_kernel(in.logits, in.targets, in.weights, lse_in, upstream, shard.vocab_begin,
                          detail::loss_params(options, shard), options.num_threads, grad);
  return {};
}

}  // namespace vpce
