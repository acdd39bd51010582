// rl/rl.cc: the RL outputs (vpce/rl.h) on logits. The forward is the engine's: each rank's
// statistics with the extras (max, sum of exp, target logit, the weighted offsets for the
// entropy) through the one all-gather, then each token's outputs (policy.h); the backward is
// the engine's gradient rows with each token's policy_gradient_constants (token_math.h). On
// the CPU, or on a CUDA device through cuda/dispatch.h (the loss's protocol and kernels with
// the RL outputs' last stage and gradient constants).
#include <vector>

#include "../cpu/kernels.h"
#include "../cuda/dispatch.h"
#include "../exchange.h"
#include "../workspace.h"
#include "policy.h"

namespace vpce::rl {

namespace {

namespace engine = vpce::detail;
using engine::LossInputs;
using engine::RowMatrix;
using engine::TokenVector;

// The logits and targets as the loss's, the temperatures (on the CPU their values too).
Status check_inputs(const TensorView& logits, const TensorView& targets, const TensorView* temperatures,
                    const VocabShard& shard, const Options& options, LossInputs* in, TokenVector* t) {
  if (Status s = engine::check_loss_inputs(logits, targets, nullptr, shard, detail::loss_options(options), in);
      !s.ok()) {
    return s;
  }
  return detail::check_temperatures(options, temperatures, in->logits.rows, logits.device, t, &in->inputs_hash);
}

std::vector<engine::NamedRegion> input_regions(const LossInputs& in, const TokenVector& temperatures) {
  return {engine::region_of("the logits", in.logits), engine::region_of("the targets", in.targets),
          engine::region_of("the temperatures", temperatures)};
}

bool on_device(const TensorView& logits) {
  return logits.device.type == DeviceType::kCUDA && engine::device_supported(logits.device, "logits").ok();
}

// The forward on device tensors: the loss's header and protocol, its buffers, kernels and
// gather on the device (cuda/dispatch.cu), the RL outputs' last stage.
Status device_forward(Communicator& comm, const LossInputs& in, const detail::PolicyOutputs& out, int64_t n,
                      const VocabShard& shard, const TensorView& logits, const TensorView& targets,
                      const Options& options, const Outputs& outputs, const TensorView* temperatures,
                      const engine::LossParams& params, Workspace* workspace, Status local) {
  if (local.ok() && workspace == nullptr) {
    local = {Code::kInvalidArgument,
             "workspace: expected a Workspace for device tensors (it holds the device buffers and the asynchronous "
             "error), got null"};
  }
  if (local.ok()) {
    local = detail::check_device_pointers({{&logits, "logits"},
                                           {&targets, "targets"},
                                           {temperatures, "temperatures"},
                                           {outputs.log_prob, "log_prob"},
                                           {outputs.entropy, "entropy"},
                                           {outputs.lse, "lse"},
                                           {outputs.mean_logit, "mean_logit"},
                                           {outputs.sum_p_squared, "sum_p_squared"}});
  }
  engine::WorkspaceLease lease(workspace);  // (none given, or held: this rank's error, but it still joins)
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  const LossOptions loss = detail::loss_options(options);
  const int64_t width = detail::stats_width(outputs);
  engine::RankHeader header =
      engine::make_header(comm.rank(), comm.size(), n, width, shard, logits.dtype, loss, false, 0,
                          detail::policy_operation(options, temperatures != nullptr, "forward"), local);
  engine::set_device_found_message(header, detail::device_found_message(params, options));
  engine::DeviceForwardArgs args{in,
                                 engine::LossOutputs{},
                                 header,
                                 local,
                                 engine::payload_bytes(n, width),
                                 n,
                                 width,
                                 shard.vocab_begin,
                                 params,
                                 loss,
                                 logits.device.id,
                                 {true, out.log_prob, out.entropy, out.lse, out.mean_logit, out.sum_p_squared}};
  return engine::device_forward(comm, args, &buffers->device);
}

}  // namespace

Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets, const VocabShard& shard,
               const Options& options, const Outputs& outputs, const TensorView* temperatures, Workspace* workspace) {
  if (Status s = engine::check_comm(comm); !s.ok()) return s;
  LossInputs in;
  TokenVector t;
  detail::PolicyOutputs out;
  Status local = check_inputs(logits, targets, temperatures, shard, options, &in, &t);
  if (local.ok()) local = detail::check_outputs(outputs, in.logits.rows, logits.device, input_regions(in, t), &out);
  const int64_t n = local.ok() ? in.logits.rows : engine::announced_tokens(targets);
  const engine::LossParams params = detail::policy_params(options, shard, t);
  if (on_device(logits)) {
    return device_forward(comm, in, out, n, shard, logits, targets, options, outputs, temperatures, params, workspace,
                          local);
  }

  engine::WorkspaceLease lease(workspace);
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  const engine::ExchangeCall call =
      detail::policy_exchange_call(n, shard, logits.dtype, options, outputs, in.inputs_hash,
                                   detail::policy_operation(options, temperatures != nullptr, "forward"));
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
  if (Status s = detail::check_upstream(lse, mean_logit, upstream, in.logits.rows, logits.device, &up); !s.ok()) {
    return s;
  }
  if (Status s = engine::check_device(grad_logits, "grad_logits", logits.device); !s.ok()) return s;
  std::vector<engine::NamedRegion> regions = detail::upstream_regions(up);
  regions.push_back(engine::region_of("the targets", in.targets));
  regions.push_back(engine::region_of("the temperatures", t));
  RowMatrix grad;
  if (Status s = engine::check_grad_logits(grad_logits, in.logits, regions, &grad); !s.ok()) return s;
  engine::LossParams params = detail::policy_params(options, shard, t);
  params.entropy_gradient = engine::present(up.grad_entropy);
  if (logits.device.type != DeviceType::kCPU) {
    if (Status s = detail::check_device_pointers({{&logits, "logits"},
                                                  {&targets, "targets"},
                                                  {&lse, "lse"},
                                                  {mean_logit, "mean_logit"},
                                                  {upstream.grad_log_prob, "grad_log_prob"},
                                                  {upstream.grad_entropy, "grad_entropy"},
                                                  {&grad_logits, "grad_logits"},
                                                  {temperatures, "temperatures"}});
        !s.ok()) {
      return s;
    }
    engine::DeviceBackwardArgs args{
        in, up.lse, TokenVector{}, grad, shard.vocab_begin, params, detail::loss_options(options), logits.device.id};
    args.policy = {true, up.grad_log_prob, up.grad_entropy, up.mean_logit};
    return engine::device_backward(args);
  }
  engine::gradient_rows(
      in.logits, in.targets, [&](int64_t i) { return up.constants(i, engine::target_at(in.targets, i), params); },
      shard.vocab_begin, params, options.num_threads, grad);
  return {};
}

}  // namespace vpce::rl
