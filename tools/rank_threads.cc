// tools/rank_threads.cc: see rank_threads.h.
#include "rank_threads.h"

#include <cstring>
#include <string>

namespace vpce::tools {

Status run_on_threads(ThreadGroup& group, const std::function<Status(Communicator&)>& fn, const char* flag,
                      std::vector<Status>* results) {
  *results = group.run(fn);
  const Status& first = results->front();
  const std::size_t prefix = std::strlen(ThreadGroup::kCouldNotStart);
  if (first.code() == Code::kSystemError && first.message().compare(0, prefix, ThreadGroup::kCouldNotStart) == 0) {
    return {Code::kSystemError, std::string(flag) + ": " + first.message().substr(prefix)};
  }
  return {};
}

}  // namespace vpce::tools
