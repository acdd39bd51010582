// common/text.h: numbers as vpce's messages print them: the shortest text that reads back
// to the same value (so -1e-10 is "-1e-10", not "-0.000000", and two values that differ in
// their last bit print differently), and dtypes by their DLPack names.
#pragma once

#include <charconv>
#include <string>

namespace vpce::detail {

template <class T>
std::string number_text(T value) {
  char text[64];
  const auto result = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, result.ptr);
}

}  // namespace vpce::detail
