// tools/checks.cc: validators and bounds shared by the subcommands (see checks.h).
#include "checks.h"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <thread>

namespace vpce::tools {
namespace {

// The value of `text` as T, or false when it is not a decimal T (including out of range).
template <class T>
bool parse_integer(const std::string& text, T* value) {
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  if (begin != end && *begin == '+') ++begin;
  const auto [stop, error] = std::from_chars(begin, end, *value);
  return error == std::errc() && stop == end && begin != end;
}

}  // namespace

CLI::Validator integer_in(int64_t min, int64_t max) {
  const std::string range = "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        int64_t value = 0;
        if (parse_integer(text, &value) && value >= min && value <= max) return {};
        return "expected " + range + ", got " + text;
      },
      "INT in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
}

namespace {

std::vector<std::string> comma_fields(const std::string& text) {
  std::vector<std::string> fields(1);
  for (char c : text) {
    if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back() += c;
    }
  }
  return fields;
}

}  // namespace

CLI::Validator integer_list_in(int64_t min, int64_t max) {
  const std::string range = "integers in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        const std::vector<std::string> fields = comma_fields(text);
        for (std::size_t i = 0; i < fields.size(); ++i) {
          int64_t value = 0;
          if (parse_integer(fields[i], &value) && value >= min && value <= max) continue;
          return "expected " + range + " separated by commas, got " + text + " (field " + std::to_string(i + 1) +
                 (fields[i].empty() ? " is empty)" : ": " + fields[i] + ")");
        }
        return {};
      },
      "INT,INT,... in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
}

std::vector<int64_t> integer_list(const std::string& text) {
  std::vector<int64_t> values;
  for (const std::string& field : comma_fields(text)) {
    int64_t value = 0;
    parse_integer(field, &value);
    values.push_back(value);
  }
  return values;
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t value = 0;
        if (parse_integer(text, &value)) return {};
        return "expected an integer in [0, 2^64 - 1], got " + text;
      },
      "UINT64");
}

CLI::Validator finite_positive() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        float value = 0.0f;  // as the flags hold it: 1e39 is infinite
        const bool number = CLI::detail::lexical_cast(text, value);
        if (number && std::isfinite(value) && value > 0.0f) return {};
        return "expected a finite number > 0, got " + text;
      },
      "FLOAT > 0");
}

CLI::Validator float32_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value = 0.0;  // read wide, so that a value float32 does not hold is told as given
        const bool number = CLI::detail::lexical_cast(text, value);
        const double magnitude = std::fabs(value);
        if (number && std::isfinite(value) && magnitude < 0x1.ffffffp127 &&
            !(magnitude > 0.0 && magnitude <= 0x1p-150)) {
          return {};
        }
        return "expected a finite number that float32 holds, got " + text;
      },
      "FLOAT");
}

int max_threads_per_rank() { return 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

Status check_threads(const char* flag, int threads) {
  const int most = max_threads_per_rank();
  if (threads >= 0 && threads <= most) return {};
  return {Code::kInvalidArgument, std::string(flag) + ": expected threads per rank in [0, " + std::to_string(most) +
                                      "] (0: the default; at most 4 x this machine's " + std::to_string(most / 4) +
                                      " hardware threads), got " + std::to_string(threads)};
}

Status check_fits_in_memory(const char* flags, double bytes, const std::string& what) {
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (bytes <= memory) return {};
  char text[128];
  std::snprintf(text, sizeof(text), "expected a size that fits in this machine's %.1f GiB of memory, got ",
                memory / 1073741824.0);
  char needs[64];
  std::snprintf(needs, sizeof(needs), ", which needs %.1f GiB", bytes / 1073741824.0);
  return {Code::kInvalidArgument, std::string(flags) + ": " + text + what + needs};
}

}  // namespace vpce::tools
