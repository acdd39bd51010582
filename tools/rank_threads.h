// tools/rank_threads.h: runs the ranks of an in-process group (ThreadGroup::run, which
// starts every thread before any rank begins) and names the command-line flag that set the
// rank count when the threads cannot be started.
#pragma once

#include <functional>
#include <vector>

#include "vpce/vpce.h"

namespace vpce::tools {

// fn(group.communicator(r)) for every rank r, each on its own thread; (*results)[r] is
// rank r's Status (an exception becomes kInternalError). If a thread cannot be started,
// no rank runs and the returned kSystemError names `flag` and how many threads started.
Status run_on_threads(ThreadGroup& group, const std::function<Status(Communicator&)>& fn, const char* flag,
                      std::vector<Status>* results);

}  // namespace vpce::tools
