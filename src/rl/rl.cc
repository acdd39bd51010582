// rl/rl.cc: the RL outputs (vpce/rl.h) on logits. The forward is the engine's: each rank's
// statistics with the extras (max, sum of exp, target logit, the weighted offsets for the
// entropy) through the one all-gather, then each token's outputs (policy.h); the backward is
// the engine's gradient rows with each token's policy_gradient_constants (token_math.h).
#include "../cpu/kernels.h"
#include "../exchange.h"
#include "../workspace.h"
#include "policy.h"

namespace vpce::rl {

namespace {

namespace engine = vpce::detail;
using engine::LossInputs;
using engine::RowMatrix;
using engine::TokenVector;

// The logits and targets as the loss's, the temperatures. Device tensors are not supported by
// the RL outputs yet.
Status check_inputs(const TensorView& logits, const TensorView& targets, const TensorView* temperatures,
                    const VocabShard& shard, const Options& options, LossInputs* in, TokenVector* t) {
  if (logits.device.type != DeviceType::kCPU) {
    return {Code::kUnsupported,
            engine::expected_got("logits.device", "cpu (the RL outputs run on the CPU in this release)",
                                 to_string(logits.device))};
  }
  if (Status s = engine::check_loss_inputs(logits, targets, nullptr, shard, detail::loss_options(options), in);
      !s.ok()) {
    return s;
  }
  return detail::check_temperatures(options, temperatures, in->logits.rows, t, &in->inputs_hash);
}

std::vector<engine::NamedRegion> input_regions(const LossInputs& in, const TokenVector& temperatures) {
  return {engine::region_of("the logits", in.logits), engine::region_of("the targets", in.targets),
          engine::region_of("the temperatures", temperatures)};
}

}  // namespace

Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets, const VocabShard& shard,
               const Options& options, const Outputs& outputs, const TensorView* temperatures, Workspace* workspace) {
  if (Status s = engine::check_comm(comm); !s.ok()) return s;
  LossInputs in;
  TokenVector t;
  detail::PolicyOutputs out;
  Status local = check_inputs(logits, targets, temperatures, shard, options, &in, &t);
  if (local.code() == Code::kUnsupported) return local;  // (every rank of a device group)
  if (local.ok()) local = detail::check_outputs(outputs, in.logits.rows, input_regions(in, t), &out);
  const int64_t n = local.ok() ? in.logits.rows : engine::announced_tokens(targets);

  Workspace own;
  Workspace::Buffers* buffers = WorkspaceAccess::buffers(workspace != nullptr ? *workspace : own);
  engine::ExchangeCall call;
  call.tokens = n;
  call.width = kStatsWidthWithExtras;
  call.shard = shard;
  call.dtype = logits.dtype;
  call.options = detail::loss_options(options);
  call.inputs_hash = in.inputs_hash;
  call.operation = detail::policy_operation(options, temperatures != nullptr, "forward");
  const engine::LossParams params = detail::policy_params(options, shard, t);
  RowMatrix merged;
  Status group = engine::exchange_stats(
      comm, *buffers, call, local,
      [&](const RowMatrix& stats) {
        engine::local_stats_kernel(in.logits, in.targets, shard.vocab_begin, params, options.num_threads, stats);
        return Status{};
      },
      &merged);
  if (!group.ok()) return group;
  detail::policy_kernel(merged, in.targets, params, options.num_threads, out);
  return {};
}

Status backward(const TensorView& logits, const TensorView& targets, const TensorView& lse,
                const TensorView* mean_logit, const Upstream& upstream, const VocabShard& shard, const Options& options,
                const TensorView& grad_logits, const TensorView* temperatures) {
  LossInputs in;
  TokenVector t;
  if (Status s = check_inputs(logits, targets, temperatures, shard, options, &in, &t); !s.ok()) return s;
  detail::PolicyUpstream up;
  if (Status s = detail::check_upstream(lse, mean_logit, upstream, in.logits.rows, &up); !s.ok()) return s;
  if (Status s = engine::check_device(grad_logits, "grad_logits", Device{}); !s.ok()) return s;
  std::vector<engine::NamedRegion> regions = detail::upstream_regions(up);
  regions.push_back(engine::region_of("the targets", in.targets));
  regions.push_back(engine::region_of("the temperatures", t));
  RowMatrix grad;
  if (Status s = engine::check_grad_logits(grad_logits, in.logits, regions, &grad); !s.ok()) return s;
  engine::LossParams params = detail::policy_params(options, shard, t);
  params.entropy_gradient = engine::present(up.grad_entropy);
  engine::gradient_rows(
      in.logits, in.targets, [&](int64_t i) { return up.constants(i, engine::target_at(in.targets, i), params); },
      shard.vocab_begin, params, options.num_threads, grad);
  return {};
}

}  // namespace vpce::rl
