// common/text.h: numbers as vpce's messages print them: the shortest text that reads back
// to the same value (so -1e-10 is "-1e-10", not "-0.000000", and two values that differ in
// their last bit print differently), dtypes by their DLPack names, and addresses in hex.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>

namespace vpce::detail {

template <class T>
std::string number_text(T value) {
  char text[64];
  const auto result = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, result.ptr);
}

// An address as messages print it: 0x followed by its hex digits.
inline std::string hex_address(const void* p) {
  char text[2 + 2 * sizeof(uintptr_t)] = {'0', 'x'};
  return std::string(text, std::to_chars(text + 2, text + sizeof(text), reinterpret_cast<uintptr_t>(p), 16).ptr);
}

}  // namespace vpce::detail
