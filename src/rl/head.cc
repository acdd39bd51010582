// rl/head.cc: the RL outputs in the fused head (vpce/rl.h's linear_forward, linear_backward
// and linear_forward_backward): the head's tile sweeps (head/tiles.h) with the RL outputs'
// parameters, per-token outputs and gradient rows (policy.h), in the recompute and the
// chunked modes.
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../cpu/kernels.h"
#include "../exchange.h"
#include "../head/device_head.h"
#include "../head/head_args.h"
#include "../head/tiles.h"
#include "../workspace.h"
#include "policy.h"

namespace vpce::rl {

namespace {

namespace engine = vpce::detail;
using engine::HeadArgs;
using engine::RowMatrix;
using engine::TokenVector;

bool on_device(const HeadInputs& inputs) { return inputs.hidden.device.type != DeviceType::kCPU; }

// The head's operands and targets, the temperatures (into the inputs' hash).
Status check_inputs(const HeadInputs& inputs, const TensorView& targets, const TensorView* temperatures,
                    const VocabShard& shard, const Options& options, const HeadOptions& head, HeadArgs* a,
                    TokenVector* t) {
  if (Status s = engine::check_head_inputs(inputs, targets, nullptr, shard, detail::loss_options(options), head, a);
      !s.ok()) {
    return s;
  }
  return detail::check_temperatures(options, temperatures, a->tokens(), Device{}, t, &a->inputs_hash);
}

std::vector<engine::NamedRegion> input_regions(const HeadArgs& a, const TokenVector& temperatures) {
  std::vector<engine::NamedRegion> regions = engine::input_regions(a);
  regions.push_back(engine::region_of("temperatures", temperatures));
  return regions;
}

// The tiles' gradient rows: token i's constants from its lse, E_p[z] and upstream gradients.
// A tile of token rows [r0, r0 + x.rows): its rows' temperatures start at r0.
engine::TileGradient policy_tile_gradient(const HeadArgs& a, const engine::SweepContext& ctx,
                                          const detail::PolicyUpstream& up) {
  return [&a, &ctx, &up](const RowMatrix& x, int64_t r0, int64_t vocab_begin) {
    engine::LossParams p = ctx.params;
    if (p.temperatures != nullptr) p.temperatures += r0 * p.temperature_stride;
    engine::gradient_rows(
        x, engine::token_slice(a.targets, r0, x.rows),
        [&](int64_t i) { return up.constants(r0 + i, engine::target_at(a.targets, r0 + i), ctx.params); }, vocab_begin,
        p, 1, x);
  };
}

// Tokens [begin, begin + count) of each output present.
detail::PolicyOutputs outputs_slice(const detail::PolicyOutputs& o, int64_t begin, int64_t count) {
  auto slice = [&](const TokenVector& v) { return engine::present(v) ? engine::token_slice(v, begin, count) : v; };
  return {slice(o.log_prob), slice(o.entropy), slice(o.lse), slice(o.mean_logit), slice(o.sum_p_squared)};
}

// linear_forward, or with `upstream` and `gradients` linear_forward_backward (the chunked mode),
// on device tensors (head/device_head.h): the head's checks there, then the RL outputs' own
// (the values of the temperatures and upstream gradients are checked or used on the device,
// not hashed; no sum_p_squared).
Status device_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets, const VocabShard& shard,
                      const Options& options, const HeadOptions& head, const Outputs& outputs,
                      const TensorView* temperatures, Workspace* workspace, const Upstream* upstream = nullptr,
                      const HeadGradients* gradients = nullptr, int64_t* collectives = nullptr) {
  const Device device = inputs.hidden.device;
  const bool chunked = upstream != nullptr;
  auto prepare = [&](Status local, const HeadArgs& a, engine::PolicyForward* p) {
    TokenVector t;
    detail::PolicyOutputs out;
    detail::PolicyUpstream up;
    uint64_t unhashed = 0;
    if (local.ok()) local = detail::check_temperatures(options, temperatures, a.tokens(), device, &t, &unhashed);
    if (local.ok() && chunked) {
      local = detail::check_upstream_gradients(*upstream, a.tokens(), device, &up);
      if (local.ok()) {
        local = detail::check_device_pointers(
            {{upstream->grad_log_prob, "grad_log_prob"}, {upstream->grad_entropy, "grad_entropy"}});
      }
    }
    if (local.ok() && outputs.sum_p_squared != nullptr) {
      local = {Code::kUnsupported,
               engine::expected_got("outputs.sum_p_squared", "null (the fused head on a device does not compute it)",
                                    "a tensor")};
    }
    if (local.ok()) local = detail::check_outputs(outputs, a.tokens(), device, input_regions(a, t), &out);
    if (local.ok()) {
      local = detail::check_device_pointers({{temperatures, "temperatures"},
                                             {outputs.log_prob, "log_prob"},
                                             {outputs.entropy, "entropy"},
                                             {outputs.lse, "lse"},
                                             {outputs.mean_logit, "mean_logit"}});
    }
    const TensorView& h = inputs.hidden;
    const int64_t hidden =
        local.ok() ? a.hidden_size() : (h.ndim >= 1 && h.ndim <= TensorView::kMaxDims ? h.shape[h.ndim - 1] : 0);
    const int64_t n = local.ok() ? a.tokens() : engine::announced_tokens(targets);
    p->operation =
        chunked ? detail::policy_operation(options, temperatures != nullptr,
                                           "fused head, chunked (linear_forward_backward)", hidden,
                                           local.ok() && a.round_logits, n)
                : detail::policy_operation(options, temperatures != nullptr, "fused head, recompute (linear_forward)",
                                           hidden, local.ok() && a.round_logits);
    p->params = detail::policy_params(options, shard, t);
    p->params.entropy_gradient = engine::present(up.grad_entropy);
    p->found_message = detail::device_found_message(p->params, options);
    p->out = {true, out.log_prob, out.entropy, out.lse, out.mean_logit, {}};
    p->upstream = {chunked, up.grad_log_prob, up.grad_entropy, {}};
    p->regions = {engine::region_of("temperatures", t), engine::region_of("log_prob", out.log_prob),
                  engine::region_of("entropy", out.entropy), engine::region_of("lse", out.lse),
                  engine::region_of("mean_logit", out.mean_logit)};
    for (const engine::NamedRegion& r : detail::upstream_regions(up)) p->regions.push_back(r);
    return local;
  };
  const LossOptions loss = detail::loss_options(options);
  if (chunked) {
    return engine::device_policy_linear_forward_backward(comm, inputs, targets, shard, loss, head, *gradients, prepare,
                                                         workspace, collectives);
  }
  return engine::device_policy_linear_forward(comm, inputs, targets, shard, loss, head, prepare, workspace);
}

// linear_backward on device tensors.
Status device_backward(const HeadInputs& inputs, const TensorView& targets, const TensorView& lse,
                       const TensorView* mean_logit, const Upstream& upstream, const VocabShard& shard,
                       const Options& options, const HeadOptions& head, const HeadGradients& gradients,
                       const TensorView* temperatures, Workspace* workspace) {
  const Device device = inputs.hidden.device;
  auto check = [&](const HeadArgs& a, TokenVector* lse_out, engine::PolicyBackwardInputs* policy,
                   engine::LossParams* params, std::vector<engine::NamedRegion>* regions) -> Status {
    TokenVector t;
    uint64_t unhashed = 0;
    if (Status s = detail::check_temperatures(options, temperatures, a.tokens(), device, &t, &unhashed); !s.ok()) {
      return s;
    }
    detail::PolicyUpstream up;
    if (Status s = detail::check_upstream(lse, mean_logit, upstream, a.tokens(), device, &up); !s.ok()) return s;
    if (Status s = detail::check_device_pointers({{temperatures, "temperatures"},
                                                  {&lse, "lse"},
                                                  {mean_logit, "mean_logit"},
                                                  {upstream.grad_log_prob, "grad_log_prob"},
                                                  {upstream.grad_entropy, "grad_entropy"}});
        !s.ok()) {
      return s;
    }
    regions->push_back(engine::region_of("temperatures", t));
    for (const engine::NamedRegion& r : detail::upstream_regions(up)) regions->push_back(r);
    *lse_out = up.lse;
    *policy = {true, up.grad_log_prob, up.grad_entropy, up.mean_logit};
    *params = detail::policy_params(options, shard, t);
    params->entropy_gradient = engine::present(up.grad_entropy);
    return {};
  };
  return engine::device_policy_linear_backward(inputs, targets, shard, detail::loss_options(options), head, gradients,
                                               check, workspace);
}

}  // namespace

Status linear_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets, const VocabShard& shard,
                      const Options& options, const HeadOptions& head, const Outputs& outputs,
                      const TensorView* temperatures, Workspace* workspace) {
  if (Status s = engine::check_comm(comm); !s.ok()) return s;
  if (on_device(inputs)) {
    return device_forward(comm, inputs, targets, shard, options, head, outputs, temperatures, workspace);
  }
  HeadArgs a;
  TokenVector t;
  detail::PolicyOutputs out;
  Status local = check_inputs(inputs, targets, temperatures, shard, options, head, &a, &t);
  if (local.ok()) local = detail::check_outputs(outputs, a.tokens(), Device{}, input_regions(a, t), &out);
  const int64_t n = local.ok() ? a.tokens() : engine::announced_tokens(targets);
  const engine::SweepContext ctx{shard.vocab_begin, detail::policy_params(options, shard, t), options.num_threads};
  engine::WorkspaceLease lease(workspace);
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  std::optional<engine::Fp32Operands> ops;
  if (local.ok()) {
    try {
      ops.emplace(a, false, options.num_threads);
    } catch (const std::bad_alloc&) {
      local = engine::head_out_of_memory("rl::linear_forward");
    }
  }
  const engine::ExchangeCall call = detail::policy_exchange_call(
      n, shard, inputs.hidden.dtype, options, outputs, a.inputs_hash,
      detail::policy_operation(options, temperatures != nullptr, "fused head, recompute (linear_forward)",
                               a.hidden_size(), a.round_logits));
  RowMatrix merged;
  Status group = engine::exchange_head_stats(comm, *buffers, call, local, a, ops ? &*ops : nullptr, ctx, 0, n, nullptr,
                                             "rl::linear_forward", &merged);
  if (!group.ok()) return group;
  detail::policy_kernel(merged, a.targets, ctx.params, options.num_threads, out);
  return {};
}

Status linear_backward(const HeadInputs& inputs, const TensorView& targets, const TensorView& lse,
                       const TensorView* mean_logit, const Upstream& upstream, const VocabShard& shard,
                       const Options& options, const HeadOptions& head, const HeadGradients& gradients,
                       const TensorView* temperatures, Workspace* workspace) {
  if (on_device(inputs)) {
    return device_backward(inputs, targets, lse, mean_logit, upstream, shard, options, head, gradients, temperatures,
                           workspace);
  }
  HeadArgs a;
  TokenVector t;
  if (Status s = check_inputs(inputs, targets, temperatures, shard, options, head, &a, &t); !s.ok()) return s;
  detail::PolicyUpstream up;
  if (Status s = detail::check_upstream(lse, mean_logit, upstream, a.tokens(), Device{}, &up); !s.ok()) return s;
  std::vector<engine::NamedRegion> regions = input_regions(a, t);
  for (const engine::NamedRegion& r : detail::upstream_regions(up)) regions.push_back(r);
  engine::HeadGradientArgs g;
  if (Status s = engine::check_head_gradients(gradients, a, regions, &g); !s.ok()) return s;
  engine::SweepContext ctx{shard.vocab_begin, detail::policy_params(options, shard, t), options.num_threads};
  ctx.params.entropy_gradient = engine::present(up.grad_entropy);
  const engine::TileGradient gradient = policy_tile_gradient(a, ctx, up);
  engine::WorkspaceLease lease(workspace);
  if (Status s = lease.status(); !s.ok()) return s;
  Workspace::Buffers* buffers = lease.buffers();
  try {
    const engine::Fp32Operands ops(a, false, options.num_threads);
    engine::sweep_gradients(a, ops, ctx, gradient, g, buffers->head_tiles);
  } catch (const std::bad_alloc&) {
    return engine::head_out_of_memory("rl::linear_backward");  // before any output was written
  }
  return {};
}

Status linear_forward_backward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                               const VocabShard& shard, const Options& options, const HeadOptions& head,
                               const Upstream& upstream, const Outputs& outputs, const HeadGradients& gradients,
                               const TensorView* temperatures, Workspace* workspace, int64_t* collectives) {
  if (collectives != nullptr) *collectives = 0;
  if (Status s = engine::check_comm(comm); !s.ok()) return s;
  if (on_device(inputs)) {
    return device_forward(comm, inputs, targets, shard, options, head, outputs, temperatures, workspace, &upstream,
                          &gradients, collectives);
  }
  HeadArgs a;
  TokenVector t;
  detail::PolicyOutputs out;
  detail::PolicyUpstream up;
  engine::HeadGradientArgs g;
  Status local = check_inputs(inputs, targets, temperatures, shard, options, head, &a, &t);
  if (local.ok()) local = detail::check_upstream_gradients(upstream, a.tokens(), Device{}, &up);
  std::vector<engine::NamedRegion> regions;
  if (local.ok()) {
    regions = input_regions(a, t);
    for (const engine::NamedRegion& r : detail::upstream_regions(up)) regions.push_back(r);
    local = detail::check_outputs(outputs, a.tokens(), Device{}, regions, &out);
  }
  if (local.ok()) {
    for (const auto& [name, v] : {std::pair{"log_prob", &out.log_prob}, std::pair{"entropy", &out.entropy},
                                  std::pair{"sum_p_squared", &out.sum_p_squared}, std::pair{"lse", &out.lse},
                                  std::pair{"mean_logit", &out.mean_logit}}) {
      regions.push_back(engine::region_of(name, *v));
    }
    local = engine::check_head_gradients(gradients, a, regions, &g);
  }
  const int64_t n = local.ok() ? a.tokens() : engine::announced_tokens(targets);
  const int64_t chunk = engine::agreed_chunk_tokens(head, shard, comm.size());
  engine::SweepContext ctx{shard.vocab_begin, detail::policy_params(options, shard, t), options.num_threads};
  ctx.params.entropy_gradient = engine::present(up.grad_entropy);
  // Everything is allocated before the first gather, so that no later step can fail alone;
  // the gradients take each token's lse and E_p[z] in float64 whatever the outputs' dtype.
  std::optional<engine::Fp32Operands> ops;
  engine::WorkspaceLease lease(workspace);
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  float* logits = nullptr;
  engine::ChunkedSums sums;
  std::vector<double> kept;
  if (local.ok()) {
    try {
      ops.emplace(a, true, options.num_threads);
      logits = engine::reserve_chunked(a, g, chunk, buffers->head_logits, sums);
      kept.resize(static_cast<std::size_t>(2 * n));
    } catch (const std::bad_alloc&) {
      local = engine::head_out_of_memory("rl::linear_forward_backward");
    }
  }
  up.lse = TokenVector{reinterpret_cast<char*>(kept.data()), kFloat64, n, 1};
  up.mean_logit = TokenVector{reinterpret_cast<char*>(kept.data() + n), kFloat64, n, 1};
  const detail::PolicyOutputs kept_out{{}, {}, up.lse, up.mean_logit, {}};
  const engine::TileGradient gradient = policy_tile_gradient(a, ctx, up);
  const engine::OperationBlock operation =
      detail::policy_operation(options, temperatures != nullptr, "fused head, chunked (linear_forward_backward)",
                               a.hidden_size(), a.round_logits, n, local.ok() ? detail::upstream_hash(up, n) : 0);
  int64_t row = 0;
  do {
    const int64_t rows = std::min(chunk, n - row);
    RowMatrix merged;
    Status group = engine::exchange_head_stats(
        comm, *buffers,
        detail::policy_exchange_call(rows, shard, inputs.hidden.dtype, options, outputs, a.inputs_hash, operation),
        local, a, ops ? &*ops : nullptr, ctx, row, rows, logits, "rl::linear_forward_backward", &merged);
    if (collectives != nullptr) ++*collectives;
    if (!group.ok()) return group;
    engine::LossParams p = ctx.params;
    if (p.temperatures != nullptr) p.temperatures += row * p.temperature_stride;
    const TokenVector chunk_targets = engine::token_slice(a.targets, row, rows);
    detail::policy_kernel(merged, chunk_targets, p, options.num_threads, outputs_slice(out, row, rows));
    detail::policy_kernel(merged, chunk_targets, p, options.num_threads, outputs_slice(kept_out, row, rows));
    engine::chunk_gradients(a, *ops, ctx, row, rows, logits, gradient, g, row == 0, sums);
    row += rows;
  } while (row < n);
  engine::finish_chunked_gradients(a, ctx, g, sums);
  return {};
}

}  // namespace vpce::rl
