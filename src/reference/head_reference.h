// reference/head_reference.h: the fused head's fp64 oracle, beside the loss's (reference.h):
// the logits x = h W^T + b of the full (unsplit) vocabulary in fp64, the loss oracle on them,
// then dh = dx W, dW = dx^T h and db = the column sums of dx, every sum in fp64. Tests only.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/reference.h"

namespace vpce::reference {

struct HeadResult {
  Result loss;                                              // loss, lse, grad [n, v] of the logits
  std::vector<double> logits;                               // [n, v]
  std::vector<double> grad_hidden, grad_weight, grad_bias;  // [n, h], [v, h], [v]
  // The same sums of |dx| |w|, |dx| |h| and |dx|: what a rounding of dx can move them by.
  std::vector<double> grad_hidden_bound, grad_weight_bound, grad_bias_bound;
};

// hidden [n, h], weight [v, h] row-major, bias [v] (empty: none); targets, weights and
// grad_loss as cross_entropy takes them. bf16_logit_gradients: dx rounded to bf16 (through
// fp32, to nearest even) before the gradients' sums, as HeadOptions::bf16_logit_gradients asks.
// logit_bits: the logits rounded to that many significant bits (8: bf16, 11: fp16), the
// product and then its sum with the bias, as HeadOptions::round_logits asks (0: exact); the
// gradients pass through the rounding unchanged.
HeadResult linear_cross_entropy(const std::vector<double>& hidden, const std::vector<double>& weight,
                                const std::vector<double>& bias, int64_t n, int64_t h, int64_t v,
                                const std::vector<int64_t>& targets, const std::vector<double>& weights,
                                const std::vector<double>& grad_loss, const Options& options,
                                bool bf16_logit_gradients = false, int logit_bits = 0);

}  // namespace vpce::reference
