// tools/rank_threads.h: runs the ranks of an in-process group on threads that are all
// started before any rank begins, so that a thread that cannot be started fails the run at
// once (ThreadGroup::run would leave the ranks already started waiting at their first
// collective until the group's timeout).
#pragma once

#include <functional>
#include <vector>

#include "vpce/vpce.h"

namespace vpce::tools {

// fn(group.communicator(r)) for every rank r, each on its own thread; (*results)[r] is
// rank r's Status (an exception becomes kInternalError). If a thread cannot be started,
// no rank runs and the kSystemError names `flag` and how many threads were started.
Status run_on_threads(ThreadGroup& group, const std::function<Status(Communicator&)>& fn, const char* flag,
                      std::vector<Status>* results);

}  // namespace vpce::tools
