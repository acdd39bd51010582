// status.cc: names of the result codes and the printed form of a Status.
#include "vpce/status.h"

namespace vpce {

const char* code_name(Code code) {
  switch (code) {
    case Code::kSuccess: return "success";
    case Code::kInvalidArgument: return "invalid argument";
    case Code::kInvalidUsage: return "invalid usage";
    case Code::kSystemError: return "system error";
    case Code::kInternalError: return "internal error";
    case Code::kRemoteError: return "remote error";
    case Code::kTimeout: return "timeout";
    case Code::kUnsupported: return "unsupported";
  }
  return "unknown code";
}

std::string Status::to_string() const {
  if (ok()) return "success";
  return std::string(code_name(code_)) + ": " + message_;
}

}  // namespace vpce
