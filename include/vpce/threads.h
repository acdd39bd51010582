// vpce/threads.h: the in-process backend, R ranks as threads of one process.
//
// The default way to run vpce on several ranks: no launcher, no MPI. A ThreadGroup holds
// the shared state of R ranks; communicator(r) is rank r's Communicator, to be used from
// one thread at a time. run() starts R threads, calls fn(comm) on each and joins them.
//
// Failure model: a rank that does not arrive at a collective within the group's timeout
// makes the waiting ranks return kTimeout, and the group is then broken: every later
// collective on it returns kInvalidUsage at once, so nothing ever waits forever. (Once all
// ranks have arrived, the copy itself is not timed: no rank leaves while another still
// reads its buffer.)
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "vpce/communicator.h"
#include "vpce/status.h"

namespace vpce {

class ThreadGroup {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};

  // num_ranks in [1, 4096]; timeout > 0.
  static Status create(int num_ranks, std::unique_ptr<ThreadGroup>* group,
                       std::chrono::milliseconds timeout = kDefaultTimeout);

  ~ThreadGroup();
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  int size() const;
  // Rank r's communicator, valid as long as the group. For r outside [0, size()) it is a
  // communicator with size() 0 on which every vpce call fails with kInvalidArgument.
  Communicator& communicator(int rank);

  // Runs fn(communicator(r)) for every r on its own thread and waits for all of them.
  // Returns each rank's Status, in rank order; an exception thrown by fn becomes
  // kInternalError for that rank. Every thread is started before any rank runs: if one
  // cannot be started, no rank runs and every entry is kSystemError, its message starting
  // with kCouldNotStart ("could not start rank threads: expected 4 rank threads, could
  // start only 2: ..."), at once rather than after the group's timeout.
  std::vector<Status> run(const std::function<Status(Communicator&)>& fn);
  static constexpr const char* kCouldNotStart = "could not start rank threads: ";

 private:
  struct Shared;
  class RankCommunicator;
  ThreadGroup(int num_ranks, std::chrono::milliseconds timeout);

  std::unique_ptr<Shared> shared_;
  std::vector<std::unique_ptr<RankCommunicator>> ranks_;
};

}  // namespace vpce
