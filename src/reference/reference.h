// reference/reference.h: the test oracle, a plain scalar fp64 implementation of the loss
// of docs/design.md section 1 over the full (unsplit) vocabulary.
//
// Written for clarity, not speed, and from the definitions rather than from vpce's
// formulas: the loss is the cross-entropy -sum_v q_v log p_v against the explicit target
// distribution q of each smoothing semantics, plus the z-loss; the gradient is
// p (1 + 2 zl lse) - q, through the logit transform's derivative. No sharding, no merging,
// no fp32 anywhere. Every fast path of vpce is tested against it.
#pragma once

#include <cstdint>
#include <vector>

namespace vpce::reference {

enum class Reduction { kNone, kSum, kMean };

struct Options {
  double label_smoothing = 0.0;
  bool pytorch_smoothing = false;  // target distribution (1 - a) onehot + a / Vv
  // Megatron's legacy smoothing, when end > begin: the target keeps 1 - s, and s spreads
  // evenly over the valid columns of [begin, end) only, s = a K / (K - 1) for K of them
  // (Megatron's per-rank loss on the shard [begin, end)).
  int64_t smoothing_begin = 0;
  int64_t smoothing_end = 0;
  int64_t ignore_index = -100;
  double z_loss = 0.0;
  double logit_scale = 1.0;
  double softcap = 0.0;
  int64_t valid_vocab = 0;  // 0: every column
  Reduction reduction = Reduction::kNone;
};

struct Result {
  std::vector<double> loss;              // [n] weighted per-token losses, or [1] reduced
  std::vector<double> lse;               // [n]
  std::vector<double> grad;              // [n, v], with respect to the raw logits x
  std::vector<double> target_is_argmax;  // [n]: 1 or 0 (0 for ignored tokens)
  std::vector<double> entropy;           // [n]
  std::vector<double> top_gap;           // [n]: z of the largest minus the second largest
};

// The unweighted loss of one non-ignored row of v raw logits (for finite differences).
double token_loss(const double* row, int64_t v, int64_t target, const Options& options);

// logits: [n, v] row-major; targets: [n]; weights: [n] or empty for ones; grad_loss: [n]
// for kNone, [1] otherwise, or empty for ones.
Result cross_entropy(const std::vector<double>& logits, int64_t n, int64_t v, const std::vector<int64_t>& targets,
                     const std::vector<double>& weights, const std::vector<double>& grad_loss, const Options& options);

// The original core: Megatron label smoothing a, no other option.
Result cross_entropy(const std::vector<double>& logits, int64_t n, int64_t v, const std::vector<int64_t>& targets,
                     double label_smoothing, const std::vector<double>& grad_loss);

// The RL outputs (vpce/rl.h) of the same logits: with z = transform(x) / T_i over the valid
// columns, p = softmax(z), the log-probability log p_y of each token's y and the entropy
// H = -sum_v p_v log p_v, and the gradient of sum_i (g_lp,i log p_y + g_H,i H_i) with respect
// to the raw logits (dH/dz_v = -p_v (log p_v + H), through dz/dx). Tokens equal to
// options.ignore_index give 0 and a zero gradient. temperatures: [n], or empty for ones;
// grad_log_prob, grad_entropy: [n], or empty for zeros.
struct PolicyResult {
  std::vector<double> log_prob;       // [n]
  std::vector<double> entropy;        // [n]
  std::vector<double> sum_p_squared;  // [n]: sum_v p_v^2 (0 for an ignored token)
  std::vector<double> grad;           // [n, v]
};
PolicyResult policy(const std::vector<double>& logits, int64_t n, int64_t v, const std::vector<int64_t>& tokens,
                    const std::vector<double>& temperatures, const std::vector<double>& grad_log_prob,
                    const std::vector<double>& grad_entropy, const Options& options);

}  // namespace vpce::reference
