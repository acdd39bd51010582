// reference/reference.h: the test oracle, a plain scalar fp64 implementation of the loss
// and gradient of docs/design.md section 1 over the full (unsplit) vocabulary.
//
// Written for clarity, not speed: no sharding, no merging, no fp32 anywhere. Every fast
// path of vpce is tested against it.
#pragma once

#include <cstdint>
#include <vector>

namespace vpce::reference {

struct Result {
  std::vector<double> loss;  // [n]
  std::vector<double> lse;   // [n]
  std::vector<double> grad;  // [n, v], d loss_i / d z_iv scaled by grad_loss_i
};

// loss_i of one row of v logits with target y and Megatron label smoothing a.
double token_loss(const double* row, int64_t v, int64_t target, double label_smoothing);

// logits: [n, v] row-major; targets: [n] in [0, v); grad_loss: [n], or empty for ones.
Result cross_entropy(const std::vector<double>& logits, int64_t n, int64_t v,
                     const std::vector<int64_t>& targets, double label_smoothing,
                     const std::vector<double>& grad_loss);

}  // namespace vpce::reference
