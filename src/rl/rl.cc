// rl/rl.cc: the RL outputs (vpce/rl.h): log-probabilities and entropy on logits. The forward
// is the engine's: each rank's statistics with the extras (max, sum of exp, target logit, the
// weighted offsets for the entropy) through the one all-gather, then each token's outputs
// from token_math.h's token_policy; the backward is the loss's gradient rows with
// token_math.h's policy_gradient_constants (the entropy's term included).
#include <bit>
#include <cmath>
#include <string>

#include "../common/text.h"
#include "../common/values_hash.h"
#include "../cpu/kernels.h"
#include "../cpu/parallel.h"
#include "../exchange.h"
#include "../validate.h"
#include "../workspace.h"
#include "vpce/rl.h"

namespace vpce::rl {

namespace {

using detail::LossInputs;
using detail::RowMatrix;
using detail::TokenVector;

LossOptions loss_options(const Options& options) {
  LossOptions o;
  o.ignore_index = options.ignore_index;
  o.logit_scale = options.logit_scale;
  o.softcap = options.softcap;
  o.valid_vocab_size = options.valid_vocab_size;
  o.num_threads = options.num_threads;
  return o;
}

Status check_temperature(const Options& options, bool per_token) {
  const float t = options.temperature;
  if (!std::isfinite(t) || t <= 0.0f || (per_token && t != 1.0f)) {
    return {Code::kInvalidArgument,
            detail::expected_got("options.temperature",
                                 per_token ? "1 (per-token temperatures are given)" : "a finite value > 0",
                                 detail::number_text(t))};
  }
  return {};
}

// Per-token temperatures: absent, or float32 with one per token, finite and > 0, their bits
// folded into `hash` (the ranks must agree on them).
Status check_temperatures(const TensorView* temperatures, int64_t n, TokenVector* out, uint64_t* hash) {
  *out = {};
  if (temperatures == nullptr) return {};
  TokenVector t;
  if (Status s = detail::as_float_tokens(*temperatures, "temperatures", n, &t); !s.ok()) return s;
  if (temperatures->device.type != DeviceType::kCPU) {
    return {Code::kInvalidArgument,
            detail::expected_got("temperatures.device", "cpu (the logits' device)", to_string(temperatures->device))};
  }
  for (int64_t i = 0; i < n; ++i) {
    const float value = t.at<float>(i);
    if (!std::isfinite(value) || value <= 0.0f) {
      return {Code::kInvalidArgument,
              detail::expected_got("temperatures", "finite values > 0",
                                   detail::number_text(value) + " at token " + std::to_string(i))};
    }
  }
  *hash = detail::extend_values_hash<uint32_t>(*hash, n,
                                               [&](int64_t i) { return std::bit_cast<uint32_t>(t.at<float>(i)); });
  *out = t;
  return {};
}

// The inputs every entry checks: the logits and targets as the loss's, the options, the
// temperatures. Device tensors are not supported by the RL outputs yet.
Status check_inputs(const TensorView& logits, const TensorView& targets, const TensorView* temperatures,
                    const VocabShard& shard, const Options& options, LossInputs* in, TokenVector* t) {
  if (logits.device.type != DeviceType::kCPU) {
    return {Code::kUnsupported,
            detail::expected_got("logits.device", "cpu (the RL outputs run on the CPU in this release)",
                                 to_string(logits.device))};
  }
  if (Status s = detail::check_loss_inputs(logits, targets, nullptr, shard, loss_options(options), in); !s.ok()) {
    return s;
  }
  if (Status s = check_temperature(options, temperatures != nullptr); !s.ok()) return s;
  return check_temperatures(temperatures, in->logits.rows, t, &in->inputs_hash);
}

detail::LossParams policy_params(const Options& options, const VocabShard& shard, const TokenVector& temperatures) {
  detail::LossParams p = detail::loss_params(loss_options(options), shard);
  p.temperature = options.temperature;
  if (detail::present(temperatures)) {
    p.temperatures = &temperatures.at<float>(0);
    p.temperature_stride = temperatures.stride;
  }
  return p;
}

// The outputs wanted, validated: float32 log_prob and entropy, float64/32 lse and mean_logit,
// one per token each, overlapping neither each other nor the inputs.
struct PolicyOutputs {
  TokenVector log_prob, entropy, lse, mean_logit;
};

Status check_outputs(const Outputs& outputs, const LossInputs& in, const TokenVector& temperatures,
                     PolicyOutputs* out) {
  const int64_t n = in.logits.rows;
  const std::pair<const TensorView*, const char*> views[] = {{outputs.log_prob, "log_prob"},
                                                             {outputs.entropy, "entropy"},
                                                             {outputs.lse, "lse"},
                                                             {outputs.mean_logit, "mean_logit"}};
  TokenVector* vectors[] = {&out->log_prob, &out->entropy, &out->lse, &out->mean_logit};
  for (int k = 0; k < 4; ++k) {
    const auto& [view, name] = views[k];
    if (view == nullptr) continue;
    if (Status s = detail::check_device(*view, name, Device{}); !s.ok()) return s;
    Status s =
        k < 2 ? detail::as_float_tokens(*view, name, n, vectors[k]) : detail::as_lse_tokens(*view, name, n, vectors[k]);
    if (!s.ok()) return s;
  }
  return detail::check_no_overlap(
      {detail::region_of("log_prob", out->log_prob), detail::region_of("entropy", out->entropy),
       detail::region_of("lse", out->lse), detail::region_of("mean_logit", out->mean_logit)},
      {detail::region_of("the logits", in.logits), detail::region_of("the targets", in.targets),
       detail::region_of("the temperatures", temperatures)});
}

// The RL outputs' block of the forward's header: the scalar temperature and whether each
// token has its own (their values are in the inputs' hash).
detail::OperationBlock policy_operation(const Options& options, bool per_token) {
  return detail::operation_block("RL outputs", "forward",
                                 {detail::float_value("options.temperature", options.temperature),
                                  {"whether temperatures are given per token", per_token ? 1 : 0}});
}

// merged stats [N, 6] -> each wanted output, per token.
void policy_kernel(const RowMatrix& stats, const TokenVector& targets, const detail::LossParams& params,
                   int num_threads, const PolicyOutputs& out) {
  detail::parallel_rows(stats.rows, num_threads, [&](int64_t i) {
    const detail::TokenPolicy t = detail::token_policy(stats.row<float>(i), detail::target_at(targets, i), params);
    if (detail::present(out.log_prob)) out.log_prob.at<float>(i) = static_cast<float>(t.log_prob);
    if (detail::present(out.entropy)) out.entropy.at<float>(i) = static_cast<float>(t.entropy);
    if (detail::present(out.lse)) detail::lse_tokens(out.lse).set(i, t.lse);
    if (detail::present(out.mean_logit)) detail::lse_tokens(out.mean_logit).set(i, t.mean_logit);
  });
}

}  // namespace

Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets, const VocabShard& shard,
               const Options& options, const Outputs& outputs, const TensorView* temperatures, Workspace* workspace) {
  if (Status s = detail::check_comm(comm); !s.ok()) return s;
  LossInputs in;
  TokenVector t;
  PolicyOutputs out;
  Status local = check_inputs(logits, targets, temperatures, shard, options, &in, &t);
  if (local.code() == Code::kUnsupported) return local;  // (every rank of a device group)
  if (local.ok()) local = check_outputs(outputs, in, t, &out);
  const int64_t n = local.ok() ? in.logits.rows : detail::announced_tokens(targets);

  Workspace own;
  Workspace::Buffers* buffers = WorkspaceAccess::buffers(workspace != nullptr ? *workspace : own);
  detail::ExchangeCall call;
  call.tokens = n;
  call.width = kStatsWidthWithExtras;
  call.shard = shard;
  call.dtype = logits.dtype;
  call.options = loss_options(options);
  call.inputs_hash = in.inputs_hash;
  call.operation = policy_operation(options, temperatures != nullptr);
  const detail::LossParams params = policy_params(options, shard, t);
  RowMatrix merged;
  Status group = detail::exchange_stats(
      comm, *buffers, call, local,
      [&](const RowMatrix& stats) {
        detail::local_stats_kernel(in.logits, in.targets, shard.vocab_begin, params, options.num_threads, stats);
        return Status{};
      },
      &merged);
  if (!group.ok()) return group;
  policy_kernel(merged, in.targets, params, options.num_threads, out);
  return {};
}

Status backward(const TensorView& logits, const TensorView& targets, const TensorView& lse,
                const TensorView* mean_logit, const Upstream& upstream, const VocabShard& shard, const Options& options,
                const TensorView& grad_logits, const TensorView* temperatures) {
  LossInputs in;
  TokenVector t;
  if (Status s = check_inputs(logits, targets, temperatures, shard, options, &in, &t); !s.ok()) return s;
  const int64_t n = in.logits.rows;
  TokenVector lse_in, mean_in, grad_log_prob, grad_entropy;
  if (Status s = detail::check_device(lse, "lse", Device{}); !s.ok()) return s;
  if (Status s = detail::as_lse_tokens(lse, "lse", n, &lse_in); !s.ok()) return s;
  const std::pair<const TensorView*, const char*> upstreams[] = {{upstream.grad_log_prob, "grad_log_prob"},
                                                                 {upstream.grad_entropy, "grad_entropy"}};
  TokenVector* upstream_vectors[] = {&grad_log_prob, &grad_entropy};
  for (int k = 0; k < 2; ++k) {
    const auto& [view, name] = upstreams[k];
    if (view == nullptr) continue;
    if (Status s = detail::check_device(*view, name, Device{}); !s.ok()) return s;
    if (Status s = detail::as_float_tokens(*view, name, n, upstream_vectors[k]); !s.ok()) return s;
  }
  if (upstream.grad_entropy != nullptr) {
    if (mean_logit == nullptr) {
      return {
          Code::kInvalidArgument,
          detail::expected_got("mean_logit", "the forward's mean_logit (E_p[z], for the entropy's gradient)", "null")};
    }
    if (Status s = detail::check_device(*mean_logit, "mean_logit", Device{}); !s.ok()) return s;
    if (Status s = detail::as_lse_tokens(*mean_logit, "mean_logit", n, &mean_in); !s.ok()) return s;
  }
  if (Status s = detail::check_device(grad_logits, "grad_logits", Device{}); !s.ok()) return s;
  RowMatrix grad;
  if (Status s = detail::check_grad_logits(
          grad_logits, in.logits,
          {detail::region_of("the targets", in.targets), detail::region_of("lse", lse_in),
           detail::region_of("mean_logit", mean_in), detail::region_of("grad_log_prob", grad_log_prob),
           detail::region_of("grad_entropy", grad_entropy), detail::region_of("the temperatures", t)},
          &grad);
      !s.ok()) {
    return s;
  }
  detail::LossParams params = policy_params(options, shard, t);
  params.entropy_gradient = detail::present(grad_entropy);
  const detail::LseTokens token_lse = detail::lse_tokens(lse_in);
  const detail::LseTokens token_mean = detail::lse_tokens(mean_in);
  detail::gradient_rows(
      in.logits, in.targets,
      [&](int64_t i) {
        const double g_lp = detail::present(grad_log_prob) ? static_cast<double>(grad_log_prob.at<float>(i)) : 0.0;
        const bool entropy = detail::present(grad_entropy);
        const double g_h = entropy ? static_cast<double>(grad_entropy.at<float>(i)) : 0.0;
        return detail::policy_gradient_constants(detail::target_at(in.targets, i), g_lp, g_h, token_lse.get(i),
                                                 entropy ? token_mean.get(i) : 0.0, params);
      },
      shard.vocab_begin, params, options.num_threads, grad);
  return {};
}

}  // namespace vpce::rl
