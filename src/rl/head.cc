// rl/head.cc: the RL outputs in the fused head (vpce/rl.h's linear_forward and
// linear_backward): the head's tile sweeps (head/tiles.h) with the RL outputs' parameters,
// per-token outputs and gradient rows (policy.h), in the recompute mode.
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "../cpu/kernels.h"
#include "../exchange.h"
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

Status device_unsupported(const HeadInputs& inputs) {
  if (inputs.hidden.device.type == DeviceType::kCPU) return {};
  return {Code::kUnsupported,
          engine::expected_got("hidden.device", "cpu (the RL outputs run on the CPU in this release)",
                               to_string(inputs.hidden.device))};
}

Status out_of_memory(const char* call) {
  return {Code::kSystemError, std::string(call) + ": could not allocate the tiles' buffers"};
}

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

}  // namespace

Status linear_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets, const VocabShard& shard,
                      const Options& options, const HeadOptions& head, const Outputs& outputs,
                      const TensorView* temperatures, Workspace* workspace) {
  if (Status s = engine::check_comm(comm); !s.ok()) return s;
  if (Status s = device_unsupported(inputs); !s.ok()) return s;  // (every rank of a device group)
  HeadArgs a;
  TokenVector t;
  detail::PolicyOutputs out;
  Status local = check_inputs(inputs, targets, temperatures, shard, options, head, &a, &t);
  if (local.ok()) local = detail::check_outputs(outputs, a.tokens(), Device{}, input_regions(a, t), &out);
  const int64_t n = local.ok() ? a.tokens() : engine::announced_tokens(targets);
  const engine::SweepContext ctx{shard.vocab_begin, detail::policy_params(options, shard, t), options.num_threads};
  std::optional<engine::Fp32Operands> ops;
  if (local.ok()) {
    try {
      ops.emplace(a, false, options.num_threads);
    } catch (const std::bad_alloc&) {
      local = out_of_memory("rl::linear_forward");
    }
  }
  Workspace own;
  Workspace::Buffers* buffers = WorkspaceAccess::buffers(workspace != nullptr ? *workspace : own);
  const engine::ExchangeCall call = detail::policy_exchange_call(
      n, shard, inputs.hidden.dtype, options, outputs, a.inputs_hash,
      detail::policy_operation(options, temperatures != nullptr, "fused head, recompute (linear_forward)",
                               a.hidden_size(), a.round_logits));
  RowMatrix merged;
  Status group = engine::exchange_stats(
      comm, *buffers, call, local,
      [&](const RowMatrix& stats) -> Status {
        try {
          engine::sweep_stats(a, *ops, ctx, 0, n, nullptr, stats, buffers->head_tiles);
        } catch (const std::bad_alloc&) {
          return out_of_memory("rl::linear_forward");
        }
        return {};
      },
      &merged);
  if (!group.ok()) return group;
  detail::policy_kernel(merged, a.targets, ctx.params, options.num_threads, out);
  return {};
}

Status linear_backward(const HeadInputs& inputs, const TensorView& targets, const TensorView& lse,
                       const TensorView* mean_logit, const Upstream& upstream, const VocabShard& shard,
                       const Options& options, const HeadOptions& head, const HeadGradients& gradients,
                       const TensorView* temperatures, Workspace* workspace) {
  if (Status s = device_unsupported(inputs); !s.ok()) return s;
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
  // A tile of token rows [r0, r0 + x.rows): its rows' temperatures start at r0.
  const engine::TileGradient gradient = [&](const RowMatrix& x, int64_t r0, int64_t vocab_begin) {
    engine::LossParams p = ctx.params;
    if (p.temperatures != nullptr) p.temperatures += r0 * p.temperature_stride;
    engine::gradient_rows(
        x, engine::token_slice(a.targets, r0, x.rows),
        [&](int64_t i) { return up.constants(r0 + i, engine::target_at(a.targets, r0 + i), ctx.params); }, vocab_begin,
        p, 1, x);
  };
  Workspace own;
  Workspace::Buffers* buffers = WorkspaceAccess::buffers(workspace != nullptr ? *workspace : own);
  try {
    const engine::Fp32Operands ops(a, false, options.num_threads);
    engine::sweep_gradients(a, ops, ctx, gradient, g, buffers->head_tiles);
  } catch (const std::bad_alloc&) {
    return out_of_memory("rl::linear_backward");  // before any output was written
  }
  return {};
}

}  // namespace vpce::rl
