// fuzz/differential_fuzzer.cc: libFuzzer drives the differential test's choices (shapes,
// shards, dtypes, options, where NaN and infinities go; tests/differential/) with its
// input bytes, and any disagreement with the fp64 oracle aborts with the case's text.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "differential.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  vpce::test::Choices choices(data, size);
  const std::string failure = vpce::test::run_differential_case(choices);
  if (!failure.empty()) {
    std::fprintf(stderr, "differential_fuzzer: %s\n", failure.c_str());
    std::abort();
  }
  return 0;
}
