// loss.cc: the staged API (local stats, merge, loss, gradient) and the backward.
//
// Each entry validates every argument, then runs its kernel; on any error it returns
// before writing anything.
#include "cpu/kernels.h"
#include "validate.h"
#include "vpce/loss.h"

namespace vpce {

using detail::LossInputs;
using detail::RowMatrix;
using detail::TokenVector;

namespace {

Status overlap_error(const char* output, const char* input) {
  return {Code::kInvalidArgument,
          detail::expected_got(output, std::string("memory that does not overlap ") + input,
                               "an overlapping buffer")};
}

}  // namespace

Status calculate_local_stats(const TensorView& logits, const TensorView& targets,
                             const VocabShard& shard, const LossOptions& options,
                             const TensorView& stats) {
  LossInputs in;
  if (Status s = detail::check_loss_inputs(logits, targets, shard, options, &in); !s.ok()) return s;
  RowMatrix out;
  if (Status s = detail::as_stats_matrix(stats, "stats", in.logits.rows, &out); !s.ok()) return s;
  if (detail::overlaps(out.begin_byte(), out.end_byte(), in.logits.begin_byte(),
                       in.logits.end_byte())) {
    return overlap_error("stats", "the logits");
  }
  if (detail::overlaps(out.begin_byte(), out.end_byte(), in.targets.base, in.targets.end_byte())) {
    return overlap_error("stats", "the targets");
  }
  const bool with_sum_logits = options.label_smoothing != 0.0f;
  detail::local_stats_kernel(in.logits, in.targets, shard.vocab_begin, with_sum_logits,
                             options.num_threads, out);
  return {};
}

Status merge_stats(const TensorView& gathered, const LossOptions& options,
                   const TensorView& stats) {
  if (Status s = detail::check_dtype("gathered", gathered.dtype, {kFloat32}, "float32"); !s.ok()) {
    return s;
  }
  if (gathered.ndim != 3) {
    return {Code::kInvalidArgument,
            detail::expected_got("gathered.ndim", "3 ([ranks, tokens, 4])",
                                 std::to_string(gathered.ndim))};
  }
  const int64_t ranks = gathered.shape[0];
  if (ranks < 1 || ranks > (1 << 20)) {
    return {Code::kInvalidArgument,
            detail::expected_got("gathered.shape[0]", "a number of ranks in [1, 2^20]",
                                 std::to_string(ranks))};
  }
  if (options.num_threads < 0) {
    return {Code::kInvalidArgument,
            detail::expected_got("options.num_threads", ">= 0", std::to_string(options.num_threads))};
  }
  // Rank r's [N, 4] block is itself a row matrix; check the first and the stride to the rest.
  TensorView block = gathered;
  block.ndim = 2;
  block.shape = {gathered.shape[1], gathered.shape[2]};
  block.strides = {gathered.strides[1], gathered.strides[2]};
  RowMatrix first;
  if (Status s = detail::as_stats_matrix(block, "gathered[r]", gathered.shape[1], &first); !s.ok()) {
    return s;
  }
  const int64_t rank_stride = gathered.strides[0];
  const int64_t block_elements = (first.end_byte() - first.begin_byte()) / 4;
  if (ranks > 1 && rank_stride < block_elements) {
    return {Code::kInvalidArgument,
            detail::expected_got("gathered.strides[0]",
                                 ">= " + std::to_string(block_elements) +
                                     " (ranks' blocks must not overlap)",
                                 std::to_string(rank_stride))};
  }
  RowMatrix out;
  if (Status s = detail::as_stats_matrix(stats, "stats", first.rows, &out); !s.ok()) return s;
  const char* gathered_end = first.begin_byte() + ((ranks - 1) * rank_stride) * 4 +
                             (first.end_byte() - first.begin_byte());
  if (detail::overlaps(out.begin_byte(), out.end_byte(), first.begin_byte(), gathered_end)) {
    return overlap_error("stats", "gathered");
  }
  detail::merge_stats_kernel(first.row<const float>(0), rank_stride, static_cast<int>(ranks),
                             first.rows, first.row_stride, options.num_threads, out);
  return {};
}

Status calculate_loss(const TensorView& stats, int64_t vocab_size, const LossOptions& options,
                      const TensorView& loss, const TensorView& lse) {
  if (vocab_size < 1) {
    return {Code::kInvalidArgument,
            detail::expected_got("vocab_size", ">= 1", std::to_string(vocab_size))};
  }
  if (Status s = detail::check_options(options, vocab_size); !s.ok()) return s;
  RowMatrix in;
  const int64_t tokens = stats.ndim >= 1 && stats.ndim <= TensorView::kMaxDims ? stats.shape[0] : 0;
  if (Status s = detail::as_stats_matrix(stats, "stats", tokens, &in); !s.ok()) return s;
  TokenVector loss_out;
  TokenVector lse_out;
  if (Status s = detail::as_float_tokens(loss, "loss", in.rows, &loss_out); !s.ok()) return s;
  if (Status s = detail::as_float_tokens(lse, "lse", in.rows, &lse_out); !s.ok()) return s;
  if (detail::overlaps(loss_out.base, loss_out.end_byte(), lse_out.base, lse_out.end_byte())) {
    return overlap_error("loss", "lse");
  }
  for (const TokenVector* out : {&loss_out, &lse_out}) {
    if (detail::overlaps(out->base, out->end_byte(), in.begin_byte(), in.end_byte())) {
      return overlap_error(out == &loss_out ? "loss" : "lse", "stats");
    }
  }
  detail::loss_kernel(in, vocab_size, detail::smoothing_terms(options.label_smoothing, vocab_size),
                      options.num_threads, loss_out, lse_out);
  return {};
}

Status backward(const TensorView& logits, const TensorView& targets, const TensorView& lse,
                const TensorView& grad_loss, const VocabShard& shard,
                const LossOptions& options, const TensorView& grad_logits) {
  LossInputs in;
  if (Status s = detail::check_loss_inputs(logits, targets, shard, options, &in); !s.ok()) return s;
  const int64_t n = in.logits.rows;
  TokenVector lse_in;
  TokenVector upstream;
  if (Status s = detail::as_float_tokens(lse, "lse", n, &lse_in); !s.ok()) return s;
  if (Status s = detail::as_float_tokens(grad_loss, "grad_loss", n, &upstream); !s.ok()) return s;
  if (Status s = detail::check_dtype("grad_logits", grad_logits.dtype,
                                     {kFloat32, kBFloat16, kFloat16}, "float32, bfloat16 or float16");
      !s.ok()) {
    return s;
  }
  RowMatrix grad;
  if (Status s = detail::as_row_matrix(grad_logits, "grad_logits", &grad); !s.ok()) return s;
  if (grad.rows != n || grad.cols != in.logits.cols) {
    return {Code::kInvalidArgument,
            detail::expected_got("grad_logits.shape",
                                 std::to_string(n) + " rows of " + std::to_string(in.logits.cols) +
                                     " (the logits' shape)",
                                 std::to_string(grad.rows) + " rows of " + std::to_string(grad.cols))};
  }
  const bool in_place = grad.base == in.logits.base;
  if (in_place && n > 0 && in.logits.cols > 0 &&
      (grad.dtype != in.logits.dtype || (n > 1 && grad.row_stride != in.logits.row_stride))) {
    return {Code::kInvalidArgument,
            detail::expected_got("grad_logits",
                                 "for an in-place gradient, the logits' dtype " +
                                     to_string(in.logits.dtype) + " and row stride " +
                                     std::to_string(in.logits.row_stride),
                                 to_string(grad.dtype) + " and row stride " +
                                     std::to_string(grad.row_stride))};
  }
  if (!in_place && detail::overlaps(grad.begin_byte(), grad.end_byte(), in.logits.begin_byte(),
                                    in.logits.end_byte())) {
    return overlap_error("grad_logits", "the logits (or exactly the logits, for in place)");
  }
  const std::pair<const char*, const TokenVector*> token_inputs[] = {
      {"the targets", &in.targets}, {"lse", &lse_in}, {"grad_loss", &upstream}};
  for (const auto& [label, vec] : token_inputs) {
    if (detail::overlaps(grad.begin_byte(), grad.end_byte(), vec->base, vec->end_byte())) {
      return overlap_error("grad_logits", label);
    }
  }
  detail::gradient_kernel(in.logits, in.targets, lse_in, upstream, shard.vocab_begin,
                          shard.vocab_size,
                          detail::smoothing_terms(options.label_smoothing, shard.vocab_size),
                          options.num_threads, grad);
  return {};
}

}  // namespace vpce
