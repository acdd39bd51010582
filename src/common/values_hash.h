// common/values_hash.h: the hash of the targets' and weights' values that each rank sends in
// its header, so that ranks given different targets or weights are told so. XXH3 (Debian's
// libxxhash-dev, used header-only), chained over blocks of the values: FNV-1a over 64-bit
// words, used before, let two different target arrays be made to collide in a few lines.
#pragma once

#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace vpce::detail {

inline constexpr uint64_t kValuesHashSeed = 0x76706365;  // "vpce"

// `hash` extended by n values value(i) of type T, read in blocks of 256.
template <class T, class Value>
uint64_t extend_values_hash(uint64_t hash, int64_t n, const Value& value) {
  T block[256];
  for (int64_t begin = 0; begin < n; begin += 256) {
    const int64_t count = n - begin < 256 ? n - begin : 256;
    for (int64_t k = 0; k < count; ++k) block[k] = value(begin + k);
    hash = XXH3_64bits_withSeed(block, static_cast<std::size_t>(count) * sizeof(T), hash);
  }
  return hash;
}

}  // namespace vpce::detail
