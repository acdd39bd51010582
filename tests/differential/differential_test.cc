// tests/differential/differential_test.cc: the differential property test: a fixed set of
// seeded cases (see differential.h) on every SIMD variant this CPU runs (support.h), each
// against the fp64 oracle. A failure names the seed and variant that reproduce it.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cstdlib>
#include <string>

#include "differential.h"
#include "support.h"

namespace vpce::test {
namespace {

// VPCE_DIFFERENTIAL_CASES overrides the number of cases per target (CI keeps the default).
uint64_t cases_per_target() {
  const char* text = std::getenv("VPCE_DIFFERENTIAL_CASES");
  return text != nullptr ? std::strtoull(text, nullptr, 10) : 200;
}

TEST(Differential, DrawnCasesMatchTheOracleOnEveryTarget) {
  const uint64_t cases = cases_per_target();
  for (const SimdVariant& variant : simd_variants()) {
    use_simd_variant(variant);
    int failures = 0;
    for (uint64_t seed = 1; seed <= cases && failures < 5; ++seed) {
      // (Both AVX3 variants draw the same cases, so the two bf16 roundings see the same inputs.)
      Choices choices(seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(variant.target));
      const std::string failure = run_differential_case(choices);
      if (!failure.empty()) {
        ++failures;
        ADD_FAILURE() << variant.name << " seed " << seed << ": " << failure;
      }
    }
  }
  use_best_simd_variant();
}

}  // namespace
}  // namespace vpce::test
