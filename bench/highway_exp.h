// bench/highway_exp.h: Highway's vectorised exp, for comparison with vpce's (bench only).
#pragma once

#include <cstdint>

namespace vpce::bench {

// y[v] = exp(x[v]) for v in [0, n) with hwy::HWY_NAMESPACE::Exp.
void highway_exp_lanes(const float* x, float* y, int64_t n);

}  // namespace vpce::bench
