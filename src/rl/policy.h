// rl/policy.h: what the RL outputs' entries share (rl.cc on logits, head.cc in the fused
// head): the options as the engine's LossOptions and LossParams, the temperatures' checks,
// the outputs' checks, the forward's operation block, the per-token outputs from merged
// statistics, and each token's gradient constants.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "../common/token_math.h"
#include "../exchange.h"
#include "../protocol.h"
#include "../validate.h"
#include "vpce/rl.h"

namespace vpce::rl::detail {

using vpce::detail::NamedRegion;
using vpce::detail::RowMatrix;
using vpce::detail::TokenVector;

// The options as the loss's (no smoothing, no z-loss, no reduction).
LossOptions loss_options(const Options& options);

// options.temperature (finite, > 0; 1 when per-token temperatures are given), then the
// per-token temperatures (absent, or float32 on `device` with one per token): on the CPU
// finite and > 0, folded into `hash` (the ranks must agree on them); on a device, their values
// are checked there (not read here).
Status check_temperatures(const Options& options, const TensorView* temperatures, int64_t n, Device device,
                          TokenVector* out, uint64_t* hash);

// The engine's constants: the loss's, with the temperature (the per-token ones when present).
vpce::detail::LossParams policy_params(const Options& options, const VocabShard& shard,
                                       const TokenVector& temperatures);

// The outputs wanted, validated: float32 log_prob, entropy and sum_p_squared, float64/32 lse and mean_logit,
// one per token each, on `device`, overlapping neither each other nor `inputs`.
struct PolicyOutputs {
  TokenVector log_prob, entropy, lse, mean_logit, sum_p_squared;
};

// The statistics' width the outputs ask for (from the arguments alone, so that a rank whose
// outputs are bad still gathers what the others do): the extras, and the squares for
// sum_p_squared.
inline int64_t stats_width(const Outputs& outputs) {
  return outputs.sum_p_squared != nullptr ? vpce::detail::kStatsWidthWithSquares : kStatsWidthWithExtras;
}
Status check_outputs(const Outputs& outputs, int64_t n, Device device, const std::vector<NamedRegion>& inputs,
                     PolicyOutputs* out);

// The forward's operation block: `mode` ("forward" on logits), the scalar temperature and
// whether each token has its own (their values are in the inputs' hash), for the fused head
// its hidden size and round_logits, and for the head's chunked mode the total token count
// and a hash of the upstream gradients (upstream_hash).
vpce::detail::OperationBlock policy_operation(const Options& options, bool per_token, const char* mode,
                                              int64_t hidden_size = 0, bool round_logits = false,
                                              int64_t head_tokens = 0, uint64_t upstream_hash = 0);

// The forward's one gather of n tokens' statistics: the width the outputs ask for, the
// options as the loss's, the inputs' hash, the operation block `operation`.
inline vpce::detail::ExchangeCall policy_exchange_call(int64_t n, const VocabShard& shard, DataType dtype,
                                                       const Options& options, const Outputs& outputs,
                                                       uint64_t inputs_hash,
                                                       const vpce::detail::OperationBlock& operation) {
  vpce::detail::ExchangeCall call;
  call.tokens = n;
  call.width = stats_width(outputs);
  call.shard = shard;
  call.dtype = dtype;
  call.options = loss_options(options);
  call.inputs_hash = inputs_hash;
  call.operation = operation;
  return call;
}

// merged stats [N, 6] (or [N, 8] with the squares) -> each wanted output, per token.
void policy_kernel(const RowMatrix& stats, const TokenVector& targets, const vpce::detail::LossParams& params,
                   int num_threads, const PolicyOutputs& out);

// Device tensors: each given view is memory of its CUDA device.
Status check_device_pointers(std::initializer_list<std::pair<const TensorView*, const char*>> views);
// Device tensors: the message a forward's header carries (while its status is 0) for a bad
// target or temperature the device finds.
std::string device_found_message(const vpce::detail::LossParams& params, const Options& options);

// The backward's upstream gradients and kept values, validated: grad_log_prob and
// grad_entropy float32 (absent: 0), lse, and mean_logit (required with grad_entropy).
struct PolicyUpstream {
  TokenVector grad_log_prob, grad_entropy, lse, mean_logit;
  // Token i's gradient constants (token_math.h's policy_gradient_constants); `target` its y.
  vpce::detail::GradientConstants constants(int64_t i, int64_t target, const vpce::detail::LossParams& params) const;
};
Status check_upstream(const TensorView& lse, const TensorView* mean_logit, const Upstream& upstream, int64_t n,
                      Device device, PolicyUpstream* out);
// The upstream gradients alone (grad_log_prob, grad_entropy), as check_upstream checks them.
Status check_upstream_gradients(const Upstream& upstream, int64_t n, Device device, PolicyUpstream* out);
// A hash of which upstream gradients are given and their values (host memory).
uint64_t upstream_hash(const PolicyUpstream& u, int64_t n);
inline std::vector<NamedRegion> upstream_regions(const PolicyUpstream& u) {
  return {vpce::detail::region_of("lse", u.lse), vpce::detail::region_of("mean_logit", u.mean_logit),
          vpce::detail::region_of("grad_log_prob", u.grad_log_prob),
          vpce::detail::region_of("grad_entropy", u.grad_entropy)};
}

}  // namespace vpce::rl::detail
