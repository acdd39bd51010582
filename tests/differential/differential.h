// tests/differential/differential.h: differential testing of vpce against the fp64 oracle
// on drawn cases: shapes, uneven shards, dtypes, strided and misaligned rows, every option,
// and non-finite logits (NaN, +inf, -inf) placed singly, as whole vectors, chunks, shards
// and rows. The choices come from a seeded generator (the ctest property test) or from a
// fuzzer's input bytes (fuzz/differential_fuzzer.cc), so both explore the same space.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>

namespace vpce::test {

// Where a case's choices come from: a fuzzer's bytes (then zeros once they run out) or a
// seeded generator.
class Choices {
 public:
  explicit Choices(uint64_t seed) : rng_(seed) {}
  Choices(const uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  uint64_t below(uint64_t bound);  // uniform in [0, bound), bound >= 1
  bool percent(int p) { return below(100) < static_cast<uint64_t>(p); }
  double unit();  // in [0, 1)

 private:
  uint64_t word();
  std::mt19937_64 rng_;
  const uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

// Draws one case from `choices`, runs it on R in-process ranks (forward and backward), and
// compares with the oracle: every per-token loss, lse and gradient element is NaN where the
// oracle's is, the same infinity where it is infinite, and within the error bound of its
// precision elsewhere (entropy and argmax too, where asked for); every rank returns the
// same bits. Returns "" when all agree, else what differed and the case's description.
std::string run_differential_case(Choices& choices);

}  // namespace vpce::test
