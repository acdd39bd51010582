// vpce/status.h: the result of every public vpce call.
//
// A short, fixed set of result codes (after NCCL's ncclResult_t) and a message that names
// the argument, the expected value and the actual one. vpce never throws across its API
// and never calls exit(); every failure comes back as a Status.
#pragma once

#include <string>
#include <utility>

namespace vpce {

enum class Code : int {
  kSuccess = 0,
  kInvalidArgument = 1,  // an argument is malformed: a shape, a pointer, a value out of range
  kInvalidUsage = 2,     // the arguments are well formed but the call is not (ranks disagree)
  kSystemError = 3,      // the operating system failed us: memory, threads, files
  kInternalError = 4,    // a bug in vpce
  kRemoteError = 5,      // another rank of the group failed
  kTimeout = 6,          // a rank did not arrive at a collective in time
  kUnsupported = 7,      // a valid request this build cannot serve (device, dtype)
};

// "success", "invalid argument", ...
const char* code_name(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == Code::kSuccess; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: targets: expected values in [0, 32000), got 32000 at token 7"
  std::string to_string() const;

 private:
  Code code_ = Code::kSuccess;
  std::string message_;
};

}  // namespace vpce
