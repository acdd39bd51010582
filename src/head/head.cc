// head/head.cc: the fused head's public functions (vpce/head.h): argument checks, the
// forward's one all-gather (exchange.h), and the tile sweeps (tiles.h) on the CPU; device
// tensors go to device_head.h.
#include <cmath>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "../cpu/kernels.h"
#include "../exchange.h"
#include "../workspace.h"
#include "device_head.h"
#include "head_args.h"
#include "tiles.h"
#include "vpce/head.h"

namespace vpce {
namespace {

using detail::HeadArgs;
using detail::HeadGradientArgs;
using detail::NamedRegion;
using detail::RowMatrix;
using detail::TokenVector;

bool on_device(const HeadInputs& inputs) {
  return inputs.hidden.device.type == DeviceType::kCUDA &&
         detail::device_supported(inputs.hidden.device, "hidden").ok();
}

// The forward's outputs (loss and extras float32, lse float64 or float32), overlapping
// neither each other nor the inputs.
Status check_forward_outputs(const HeadArgs& a, const LossOptions& options, const TensorView& loss,
                             const TensorView& lse, const ForwardExtras& extras, detail::LossOutputs* out) {
  return detail::check_forward_outputs(a.tokens(), Device{}, options, loss, lse, extras, detail::input_regions(a), out);
}

int64_t stats_width(const ForwardExtras& extras) {
  return extras.target_is_argmax != nullptr || extras.entropy != nullptr ? kStatsWidthWithExtras : kStatsWidth;
}

// `chunked`: the chunked mode's gather of a chunk of `tokens` of all `head_tokens`.
detail::ExchangeCall exchange_call(const HeadArgs& a, int64_t tokens, int64_t width, const VocabShard& shard,
                                   const HeadInputs& inputs, const LossOptions& options, bool has_weights, bool chunked,
                                   int64_t head_tokens = 0, float grad_loss = 0.0f) {
  detail::ExchangeCall call;
  call.tokens = tokens;
  call.width = width;
  call.shard = shard;
  call.dtype = inputs.hidden.dtype;
  call.options = options;
  call.has_weights = has_weights;
  call.operation = detail::head_operation(a.hidden_size(), chunked, head_tokens, grad_loss, a.round_logits);
  call.inputs_hash = a.inputs_hash;
  return call;
}

detail::SweepContext sweep_context(const VocabShard& shard, const LossOptions& options) {
  return {shard.vocab_begin, detail::loss_params(options, shard), options.num_threads};
}

}  // namespace

Status linear_cross_entropy_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                    const VocabShard& shard, const LossOptions& options, const HeadOptions& head,
                                    const TensorView& loss, const TensorView& lse, const ForwardExtras& extras,
                                    Workspace* workspace) {
  if (Status s = detail::check_comm(comm); !s.ok()) return s;
  if (on_device(inputs)) {
    return detail::device_linear_cross_entropy_forward(comm, inputs, targets, shard, options, head, loss, lse, extras,
                                                       workspace);
  }
  HeadArgs a;
  detail::LossOutputs out;
  Status local = detail::check_head_inputs(inputs, targets, extras.weights, shard, options, head, &a);
  if (local.ok()) local = check_forward_outputs(a, options, loss, lse, extras, &out);
  const int64_t n = local.ok() ? a.tokens() : detail::announced_tokens(targets);
  const int64_t width = stats_width(extras);
  const detail::SweepContext ctx = sweep_context(shard, options);
  detail::WorkspaceLease lease(workspace);
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  std::optional<detail::Fp32Operands> ops;
  if (local.ok()) {
    try {
      ops.emplace(a, false, options.num_threads);
    } catch (const std::bad_alloc&) {
      local = detail::head_out_of_memory("linear_cross_entropy_forward");
    }
  }
  RowMatrix merged;
  Status group = detail::exchange_head_stats(
      comm, *buffers, exchange_call(a, n, width, shard, inputs, options, extras.weights != nullptr, false), local, a,
      ops ? &*ops : nullptr, ctx, 0, n, nullptr, "linear_cross_entropy_forward", &merged);
  if (!group.ok()) return group;
  detail::loss_kernel(merged, a.targets, a.weights, ctx.params, options.num_threads, out);
  return {};
}

Status linear_cross_entropy_backward(const HeadInputs& inputs, const TensorView& targets, const TensorView& lse,
                                     const TensorView& grad_loss, const VocabShard& shard, const LossOptions& options,
                                     const HeadOptions& head, const HeadGradients& gradients, const TensorView* weights,
                                     Workspace* workspace) {
  if (on_device(inputs)) {
    return detail::device_linear_cross_entropy_backward(inputs, targets, lse, grad_loss, shard, options, head,
                                                        gradients, weights, workspace);
  }
  HeadArgs a;
  if (Status s = detail::check_head_inputs(inputs, targets, weights, shard, options, head, &a); !s.ok()) return s;
  for (const auto& [view, name] : {std::pair{&lse, "lse"}, std::pair{&grad_loss, "grad_loss"}}) {
    if (Status s = detail::check_device(*view, name, Device{}); !s.ok()) return s;
  }
  TokenVector lse_in, upstream;
  if (Status s = detail::as_lse_tokens(lse, "lse", a.tokens(), &lse_in); !s.ok()) return s;
  if (Status s = detail::check_loss_output(grad_loss, "grad_loss", a.tokens(), options.reduction, &upstream); !s.ok()) {
    return s;
  }
  std::vector<NamedRegion> regions = detail::input_regions(a);
  regions.push_back(detail::region_of("lse", lse_in));
  regions.push_back(detail::region_of("grad_loss", upstream));
  HeadGradientArgs g;
  if (Status s = detail::check_head_gradients(gradients, a, regions, &g); !s.ok()) return s;
  const detail::SweepContext ctx = sweep_context(shard, options);
  detail::WorkspaceLease lease(workspace);
  if (Status s = lease.status(); !s.ok()) return s;
  Workspace::Buffers* buffers = lease.buffers();
  try {
    const detail::Fp32Operands ops(a, false, options.num_threads);
    detail::sweep_gradients(
        a, ops, ctx,
        detail::loss_tile_gradient(a, ctx, lse_in, detail::upstream_of(upstream, a.targets, a.weights, ctx.params)), g,
        buffers->head_tiles);
  } catch (const std::bad_alloc&) {
    return detail::head_out_of_memory("linear_cross_entropy_backward");  // before any output was written
  }
  return {};
}

Status linear_cross_entropy_forward_backward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                             const VocabShard& shard, const LossOptions& options,
                                             const HeadOptions& head, float grad_loss, const TensorView& loss,
                                             const TensorView& lse, const HeadGradients& gradients,
                                             const ForwardExtras& extras, Workspace* workspace, int64_t* collectives) {
  if (Status s = detail::check_comm(comm); !s.ok()) return s;
  if (on_device(inputs)) {
    return detail::device_linear_cross_entropy_forward_backward(comm, inputs, targets, shard, options, head, grad_loss,
                                                                loss, lse, gradients, extras, workspace, collectives);
  }
  if (collectives != nullptr) *collectives = 0;
  HeadArgs a;
  detail::LossOutputs out;
  HeadGradientArgs g;
  Status local = detail::check_head_inputs(inputs, targets, extras.weights, shard, options, head, &a);
  if (local.ok() && options.reduction == Reduction::kNone) {
    local = {
        Code::kInvalidArgument,
        detail::expected_got("options.reduction",
                             "sum or mean (the chunked mode needs the upstream gradient of one reduced loss)", "none")};
  }
  if (local.ok() && !std::isfinite(grad_loss)) {
    local = {Code::kInvalidArgument, detail::expected_got("grad_loss", "a finite value", std::to_string(grad_loss))};
  }
  if (local.ok()) local = check_forward_outputs(a, options, loss, lse, extras, &out);
  if (local.ok()) {
    std::vector<NamedRegion> regions = detail::input_regions(a);
    for (const auto& [v, name] :
         {std::pair{&out.loss, "loss"}, std::pair{&out.lse, "lse"},
          std::pair{&out.target_is_argmax, "target_is_argmax"}, std::pair{&out.entropy, "entropy"}}) {
      regions.push_back(detail::region_of(name, *v));
    }
    local = detail::check_head_gradients(gradients, a, regions, &g);
  }
  const int64_t n = local.ok() ? a.tokens() : detail::announced_tokens(targets);
  const int64_t width = stats_width(extras);
  const int64_t chunk = detail::agreed_chunk_tokens(head, shard, comm.size());
  const detail::SweepContext ctx = sweep_context(shard, options);
  // Everything is allocated before the first gather, so that no later step can fail alone.
  std::optional<detail::Fp32Operands> ops;
  detail::WorkspaceLease lease(workspace);
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  float* logits = nullptr;
  std::vector<float> all_stats;
  detail::ChunkedSums sums;
  if (local.ok()) {
    try {
      ops.emplace(a, true, options.num_threads);
      logits = detail::reserve_chunked(a, g, chunk, buffers->head_logits, sums);
      all_stats.resize(static_cast<std::size_t>(n * width));
    } catch (const std::bad_alloc&) {
      local = detail::head_out_of_memory("linear_cross_entropy_forward_backward");
    }
  }
  const float one[1] = {grad_loss};
  const TokenVector scalar{const_cast<char*>(reinterpret_cast<const char*>(one)), kFloat32, 1, 1};
  const detail::Upstream upstream = detail::upstream_of(scalar, a.targets, a.weights, ctx.params);
  const RowMatrix stats_all{reinterpret_cast<char*>(all_stats.data()), kFloat32, n, width, width};
  int64_t row = 0;
  do {
    const int64_t rows = std::min(chunk, n - row);
    RowMatrix merged;
    Status group = detail::exchange_head_stats(
        comm, *buffers,
        exchange_call(a, rows, width, shard, inputs, options, extras.weights != nullptr, true, n, grad_loss), local, a,
        ops ? &*ops : nullptr, ctx, row, rows, logits, "linear_cross_entropy_forward_backward", &merged);
    if (collectives != nullptr) ++*collectives;
    if (!group.ok()) return group;
    const detail::LseTokens lse_out = detail::lse_tokens(out.lse);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = stats_all.row<float>(row + r);
      std::memcpy(dst, merged.row<float>(r), static_cast<std::size_t>(width) * sizeof(float));
      const int64_t t = row + r;
      const double w = a.weights.base != nullptr ? static_cast<double>(a.weights.at<float>(t)) : 1.0;
      lse_out.set(
          t,
          detail::token_loss(dst, detail::target_at(a.targets, t), w, ctx.params, width == kStatsWidthWithExtras).lse);
    }
    detail::chunk_gradients(a, *ops, ctx, row, rows, logits, detail::loss_tile_gradient(a, ctx, out.lse, upstream), g,
                            row == 0, sums);
    row += rows;
  } while (row < n);
  detail::finish_chunked_gradients(a, ctx, g, sums);
  detail::loss_kernel(stats_all, a.targets, a.weights, ctx.params, options.num_threads, out);
  return {};
}

Status linear_cross_entropy_local_stats(const HeadInputs& inputs, const TensorView& targets, const VocabShard& shard,
                                        const LossOptions& options, const HeadOptions& head, const TensorView& stats) {
  if (on_device(inputs)) {
    return detail::device_linear_cross_entropy_local_stats(inputs, targets, shard, options, head, stats);
  }
  HeadArgs a;
  if (Status s = detail::check_head_inputs(inputs, targets, nullptr, shard, options, head, &a); !s.ok()) return s;
  if (Status s = detail::check_device(stats, "stats", Device{}); !s.ok()) return s;
  if (stats.ndim != 2) {
    return {Code::kInvalidArgument,
            detail::expected_got("stats.ndim", "2 ([tokens, 4 or 6])", std::to_string(stats.ndim))};
  }
  const int64_t width = stats.shape[1] == kStatsWidthWithExtras ? kStatsWidthWithExtras : kStatsWidth;
  RowMatrix out;
  if (Status s = detail::as_stats_matrix(stats, "stats", a.tokens(), width, &out); !s.ok()) return s;
  if (Status s = detail::check_no_overlap({{"stats", out.begin_byte(), out.end_byte()}}, detail::input_regions(a));
      !s.ok()) {
    return s;
  }
  try {
    const detail::Fp32Operands ops(a, false, options.num_threads);
    detail::HostFloats tiles;
    detail::sweep_stats(a, ops, sweep_context(shard, options), 0, a.tokens(), nullptr, out, tiles);
  } catch (const std::bad_alloc&) {
    return detail::head_out_of_memory("linear_cross_entropy_local_stats");
  }
  return {};
}

}  // namespace vpce
