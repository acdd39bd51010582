// tools/checks.h: what every subcommand shares to refuse bad values up front: validators
// for CLI11 options that name the flag, the expected range and the value given; the bounds
// on thread and rank counts; and the guard that turns allocation failure into an error.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "vpce/status.h"

namespace vpce::tools {

// At most this many ranks in one process (--tp, perf -t).
constexpr int kMaxRanks = 1024;

// An integer in [min, max], written in decimal; anything else (text, a fraction, a value
// out of range, which CLI11 would clamp) is refused with the range and the value.
CLI::Validator integer_in(int64_t min, int64_t max);
// Integers in [min, max] separated by commas, every field one (CLI11's own splitting drops an
// empty field: ",5,5" would be read as "5,5"); integer_list() reads them once checked.
CLI::Validator integer_list_in(int64_t min, int64_t max);
std::vector<int64_t> integer_list(const std::string& text);
// A 64-bit unsigned integer (a seed).
CLI::Validator unsigned_integer();
// A finite number > 0.
CLI::Validator finite_positive();

// A finite number that float32 holds (1e39 overflows to inf, 1e-50 to 0): named as given.
CLI::Validator float32_number();

// The most threads per rank a flag may ask for: 4 x this machine's hardware threads.
int max_threads_per_rank();
// `flag` (threads per rank, 0: the default) in [0, max_threads_per_rank()].
Status check_threads(const char* flag, int threads);

// kInvalidArgument naming `flags` when `bytes` exceed this machine's physical memory (a
// request no allocation could serve; refused before trying, so that no allocator, a
// sanitizer's included, aborts on it), with `what` describing the request.
Status check_fits_in_memory(const char* flags, double bytes, const std::string& what);

// f(), with an allocation failure turned into kSystemError "<what>: out of memory ...".
template <class F>
Status catch_out_of_memory(const std::string& what, F&& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return {Code::kSystemError, what + ": out of memory (an allocation failed)"};
  } catch (const std::length_error&) {
    return {Code::kSystemError, what + ": out of memory (a buffer larger than the address space)"};
  }
}

}  // namespace vpce::tools
