// bench/highway_exp.cc: Highway's own vectorised exp (hwy/contrib/math), dispatched at run
// time like vpce's kernels, so that vpce_kernels_bench can set vpce's exp beside it.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "highway_exp.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <cmath>
#include <cstdint>

#include "highway_exp.h"

HWY_BEFORE_NAMESPACE();
namespace vpce::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void HighwayExpImpl(const float* x, float* y, int64_t n) {
  const hn::ScalableTag<float> d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  int64_t v = 0;
  for (; v + lanes <= n; v += lanes) hn::StoreU(hn::Exp(d, hn::LoadU(d, x + v)), d, y + v);
  for (; v < n; ++v) y[v] = std::exp(x[v]);
}

}  // namespace HWY_NAMESPACE
}  // namespace vpce::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace vpce::bench {
HWY_EXPORT(HighwayExpImpl);
void highway_exp_lanes(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(HighwayExpImpl)(x, y, n); }
}  // namespace vpce::bench
#endif
