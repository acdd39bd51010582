// rl/policy.cc: the RL outputs' shared checks and per-token work (policy.h).
#include "policy.h"

#include <bit>
#include <cstdint>
#include <string>

#include "../common/text.h"
#include "../common/values_hash.h"
#include "../cpu/kernels.h"
#include "../cpu/parallel.h"

namespace vpce::rl::detail {

namespace engine = vpce::detail;

LossOptions loss_options(const Options& options) {
  LossOptions o;
  o.ignore_index = options.ignore_index;
  o.logit_scale = options.logit_scale;
  o.softcap = options.softcap;
  o.valid_vocab_size = options.valid_vocab_size;
  o.num_threads = options.num_threads;
  o.stream = options.stream;
  return o;
}

namespace {

// The smallest temperature engine::usable_temperature takes with these options, and why there
// is one: for the messages (positive floats are ordered as their bits).
std::string usable_temperatures(const Options& options, const char* one_or_many) {
  uint32_t low = 1, high = std::bit_cast<uint32_t>(1.0f);
  while (low < high) {
    const uint32_t middle = low + (high - low) / 2;
    if (engine::usable_temperature(options.logit_scale, options.softcap, std::bit_cast<float>(middle))) {
      high = middle;
    } else {
      low = middle + 1;
    }
  }
  return std::string(one_or_many) + " >= " + engine::number_text(std::bit_cast<float>(low)) +
         (options.softcap > 0.0f ? " (logit_scale / T and softcap / T must be finite in fp32)"
                                 : " (logit_scale / T must be finite in fp32)");
}

}  // namespace

Status check_temperatures(const Options& options, const TensorView* temperatures, int64_t n, Device device,
                          TokenVector* out, uint64_t* hash) {
  *out = {};
  const float scalar = options.temperature;
  const bool per_token = temperatures != nullptr;
  if (per_token ? scalar != 1.0f : !engine::usable_temperature(options.logit_scale, options.softcap, scalar)) {
    return {Code::kInvalidArgument,
            engine::expected_got("options.temperature",
                                 per_token ? "1 (per-token temperatures are given)"
                                           : usable_temperatures(options, "a finite value > 0 and"),
                                 engine::number_text(scalar))};
  }
  if (!per_token) return {};
  if (Status s = engine::check_device(*temperatures, "temperatures", device); !s.ok()) return s;
  TokenVector t;
  if (Status s = engine::as_float_tokens(*temperatures, "temperatures", n, &t); !s.ok()) return s;
  if (device.type != DeviceType::kCPU) {
    *out = t;
    return {};
  }
  for (int64_t i = 0; i < n; ++i) {
    const float value = t.at<float>(i);
    if (!engine::usable_temperature(options.logit_scale, options.softcap, value)) {
      return {Code::kInvalidArgument,
              engine::expected_got("temperatures", usable_temperatures(options, "finite values > 0 and"),
                                   engine::number_text(value) + " at token " + std::to_string(i))};
    }
  }
  *hash = engine::extend_values_hash<uint32_t>(*hash, n,
                                               [&](int64_t i) { return std::bit_cast<uint32_t>(t.at<float>(i)); });
  *out = t;
  return {};
}

engine::LossParams policy_params(const Options& options, const VocabShard& shard, const TokenVector& temperatures) {
  engine::LossParams p = engine::loss_params(loss_options(options), shard);
  p.temperature = options.temperature;
  if (engine::present(temperatures)) {
    p.temperatures = &temperatures.at<float>(0);
    p.temperature_stride = temperatures.stride;
  }
  return p;
}

Status check_outputs(const Outputs& outputs, int64_t n, Device device, const std::vector<NamedRegion>& inputs,
                     PolicyOutputs* out) {
  const std::pair<const TensorView*, const char*> views[] = {{outputs.log_prob, "log_prob"},
                                                             {outputs.entropy, "entropy"},
                                                             {outputs.sum_p_squared, "sum_p_squared"},
                                                             {outputs.lse, "lse"},
                                                             {outputs.mean_logit, "mean_logit"}};
  TokenVector* vectors[] = {&out->log_prob, &out->entropy, &out->sum_p_squared, &out->lse, &out->mean_logit};
  for (int k = 0; k < 5; ++k) {
    const auto& [view, name] = views[k];
    if (view == nullptr) continue;
    if (Status s = engine::check_device(*view, name, device); !s.ok()) return s;
    Status s =
        k < 3 ? engine::as_float_tokens(*view, name, n, vectors[k]) : engine::as_lse_tokens(*view, name, n, vectors[k]);
    if (!s.ok()) return s;
  }
  return engine::check_no_overlap(
      {engine::region_of("log_prob", out->log_prob), engine::region_of("entropy", out->entropy),
       engine::region_of("sum_p_squared", out->sum_p_squared), engine::region_of("lse", out->lse),
       engine::region_of("mean_logit", out->mean_logit)},
      inputs);
}

vpce::detail::OperationBlock policy_operation(const Options& options, bool per_token, const char* mode,
                                              int64_t hidden_size, bool round_logits, int64_t head_tokens,
                                              uint64_t upstream_hash) {
  return engine::operation_block("RL outputs", mode,
                                 {// (first: a rank with per-token temperatures has options.temperature 1)
                                  {"whether temperatures are given per token", per_token ? 1 : 0},
                                  engine::float_value("options.temperature", options.temperature),
                                  {"the hidden size of the fused head", hidden_size},
                                  {"head.round_logits", round_logits ? 1 : 0},
                                  {"the number of tokens", head_tokens},
                                  {"a hash of the upstream gradients' values", static_cast<int64_t>(upstream_hash)}});
}

void policy_kernel(const RowMatrix& stats, const TokenVector& targets, const engine::LossParams& params,
                   int num_threads, const PolicyOutputs& out) {
  engine::parallel_rows(stats.rows, num_threads, [&](int64_t i) {
    const engine::TokenPolicy t = engine::token_policy(stats.row<float>(i), engine::target_at(targets, i), params,
                                                       stats.cols == engine::kStatsWidthWithSquares);
    if (engine::present(out.log_prob)) out.log_prob.at<float>(i) = static_cast<float>(t.log_prob);
    if (engine::present(out.entropy)) out.entropy.at<float>(i) = static_cast<float>(t.entropy);
    if (engine::present(out.sum_p_squared)) out.sum_p_squared.at<float>(i) = static_cast<float>(t.sum_p_squared);
    if (engine::present(out.lse)) engine::lse_tokens(out.lse).set(i, t.lse);
    if (engine::present(out.mean_logit)) engine::lse_tokens(out.mean_logit).set(i, t.mean_logit);
  });
}

Status check_device_pointers(std::initializer_list<std::pair<const TensorView*, const char*>> views) {
  for (const auto& [view, name] : views) {
    if (view == nullptr) continue;
    if (Status s = engine::check_device_pointer(*view, name); !s.ok()) return s;
  }
  return {};
}

std::string device_found_message(const engine::LossParams& params, const Options& options) {
  return "targets or temperatures: expected targets in [0, " + std::to_string(params.valid_vocab) + ") or " +
         std::to_string(options.ignore_index) + " and " + usable_temperatures(options, "temperatures > 0 and") +
         ", got another value (found on the device)";
}

engine::GradientConstants PolicyUpstream::constants(int64_t i, int64_t target, const engine::LossParams& params) const {
  const double g_lp = engine::present(grad_log_prob) ? static_cast<double>(grad_log_prob.at<float>(i)) : 0.0;
  const bool entropy = engine::present(grad_entropy);
  const double g_h = entropy ? static_cast<double>(grad_entropy.at<float>(i)) : 0.0;
  return engine::policy_gradient_constants(target, g_lp, g_h, engine::lse_tokens(lse).get(i),
                                           entropy ? engine::lse_tokens(mean_logit).get(i) : 0.0, params);
}

Status check_upstream_gradients(const Upstream& upstream, int64_t n, Device device, PolicyUpstream* out) {
  const std::pair<const TensorView*, const char*> upstreams[] = {{upstream.grad_log_prob, "grad_log_prob"},
                                                                 {upstream.grad_entropy, "grad_entropy"}};
  TokenVector* vectors[] = {&out->grad_log_prob, &out->grad_entropy};
  for (int k = 0; k < 2; ++k) {
    const auto& [view, name] = upstreams[k];
    if (view == nullptr) continue;
    if (Status s = engine::check_device(*view, name, device); !s.ok()) return s;
    if (Status s = engine::as_float_tokens(*view, name, n, vectors[k]); !s.ok()) return s;
  }
  return {};
}

uint64_t upstream_hash(const PolicyUpstream& u, int64_t n) {
  uint64_t hash = engine::kValuesHashSeed;
  for (const TokenVector* v : {&u.grad_log_prob, &u.grad_entropy}) {
    const bool given = engine::present(*v);
    hash = engine::extend_values_hash<uint32_t>(hash, given ? n + 1 : 1, [&](int64_t i) {
      return i == 0 ? (given ? 1U : 0U) : std::bit_cast<uint32_t>(v->at<float>(i - 1));
    });
  }
  return hash;
}

Status check_upstream(const TensorView& lse, const TensorView* mean_logit, const Upstream& upstream, int64_t n,
                      Device device, PolicyUpstream* out) {
  if (Status s = engine::check_device(lse, "lse", device); !s.ok()) return s;
  if (Status s = engine::as_lse_tokens(lse, "lse", n, &out->lse); !s.ok()) return s;
  if (Status s = check_upstream_gradients(upstream, n, device, out); !s.ok()) return s;
  if (upstream.grad_entropy == nullptr) return {};
  if (mean_logit == nullptr) {
    return {
        Code::kInvalidArgument,
        engine::expected_got("mean_logit", "the forward's mean_logit (E_p[z], for the entropy's gradient)", "null")};
  }
  if (Status s = engine::check_device(*mean_logit, "mean_logit", device); !s.ok()) return s;
  return engine::as_lse_tokens(*mean_logit, "mean_logit", n, &out->mean_logit);
}

}  // namespace vpce::rl::detail
