// vpce/mpi.h: the MPI backend: a tensor-parallel group is an MPI communicator.
//
// Build with -DVPCE_WITH_MPI=ON (the default when CMake finds MPI) and link vpce::mpi.
// Works with any MPI-3 library (tested with Open MPI and MPICH) and with any communicator:
// MPI_COMM_WORLD, or one tensor-parallel group split out of a larger job.
//
//   std::unique_ptr<vpce::MpiCommunicator> comm;
//   vpce::Status s = vpce::MpiCommunicator::create(tp_comm, &comm);   // collective
//   s = vpce::forward(*comm, logits, targets, shard, options, loss, lse);
//
// The forward makes exactly one MPI collective per call (an all-gather); the backward
// none. The communicator is duplicated at creation, so vpce's messages never mix with the
// caller's, and the duplicate returns errors instead of aborting (MPI_ERRORS_RETURN).
//
// Size agreement. MPI requires every rank of a collective to pass the same count, so a
// rank that disagreed on the number of tokens would be undefined behaviour. This backend
// therefore gathers fixed-size blocks of an agreed capacity (4 KiB at first: 240 tokens),
// each starting with the sender's true size: a call whose payload fits the capacity is one
// collective; a call whose payload does not fit is one small collective that agrees the
// new size, then the gather itself. The capacity shrinks again only when a payload uses
// less than a quarter of it. If the sizes differ, every rank returns the same
// kInvalidUsage error.
//
// Failure. A rank that dies ends the job: Open MPI's and MPICH's launchers kill the
// remaining ranks. A rank that is alive but never arrives makes the others return
// kTimeout after MpiOptions::timeout. The collective cannot be cancelled, so the
// communicator is then broken (every later call returns kInvalidUsage at once) and the
// usual response is MPI_Abort. Threads: call from one thread at a time; MPI must be
// initialised with a thread level that allows that thread to call MPI.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <memory>

#include "vpce/communicator.h"
#include "vpce/status.h"

namespace vpce {

struct MpiOptions {
  // How long a rank waits for the others at the collective, at most 30 days. Zero: wait
  // forever (then only the launcher ends a job whose rank hangs). Ranks may differ in it.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class MpiCommunicator final : public Communicator {
 public:
  // Collective over `comm` (it duplicates it); every rank succeeds or every rank fails. MPI
  // must be initialised; `comm` must not be MPI_COMM_NULL; 0 <= options.timeout <= 30 days.
  static Status create(MPI_Comm comm, std::unique_ptr<MpiCommunicator>* out, const MpiOptions& options = {});

  // Frees the duplicate communicator (destroy it before MPI_Finalize).
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  Status all_gather(const void* send, void* recv, std::size_t bytes) override;
  const char* name() const override { return "mpi"; }

  // The agreed block capacity in bytes (grows with the payload; for tests and tuning).
  std::size_t capacity() const;

  // This rank's timeout from now on (local, not collective; ranks may differ), with the
  // limits of MpiOptions::timeout: for instance a long one for a first step that waits for
  // compilation, then a short one.
  Status set_timeout(std::chrono::milliseconds timeout);

 private:
  struct State;
  explicit MpiCommunicator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace vpce
