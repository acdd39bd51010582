// tools/mpi_collectives.h: the collectives `vpce run --backend mpi` makes itself, on
// MPI_COMM_WORLD. Each is non-blocking and waited for at most the --timeout, polling with a
// sleep between tests (as the library's MPI backend bounds its own waits), so that a rank
// that stops makes the others fail instead of spinning forever. Every rank makes them in
// the same order.
#pragma once

#include <mpi.h>

#include <chrono>

#include "commands.h"

namespace vpce::tools {

class ToolCollectives {
 public:
  ToolCollectives(int rank, int ranks, std::chrono::milliseconds timeout)
      : rank_(rank), ranks_(ranks), timeout_(timeout) {}

  int rank() const { return rank_; }
  int size() const { return ranks_; }

  // Waits for `request` (kTimeout naming `what` after the timeout).
  Status wait(MPI_Request* request, const char* what) const;

  // The first collective: every flag of `config` compared across the ranks (a hash of each
  // value, and its text for the message). On disagreement every rank gets the same
  // kInvalidArgument naming the first flag that differs and two of its values. Also counts
  // the ranks on this rank's host, for the default thread count.
  Status agree_flags(const RunConfig& config, int* ranks_on_host) const;

  // The status of the lowest failing rank, the same on every rank (prefixed "rank r: ").
  // A local kTimeout comes back at once: the others cannot all be reached any more.
  Status agree(const Status& local) const;

  // The largest of every rank's `local`, on every rank.
  Status max(double local, double* out) const;
  Status barrier() const;

 private:
  Status all_gather(const void* mine, void* all, int bytes, const char* what) const;

  int rank_;
  int ranks_;
  std::chrono::milliseconds timeout_;
};

}  // namespace vpce::tools
