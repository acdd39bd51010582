// vpce/communicator.h: the one collective vpce needs, as an interface.
//
// vpce's forward exchanges a few bytes per token between the ranks of a tensor-parallel
// group through exactly one call to Communicator::all_gather; the backward exchanges
// nothing. Kernels never see a communicator: the one-call forward (vpce/loss.h) calls it
// between the local-statistics stage and the merge. Backends implement this interface:
// in-process threads (vpce/threads.h), and later MPI and NCCL. A framework that owns its
// collectives can instead call the staged API and gather the statistics itself.
#pragma once

#include <cstddef>
#include <string>

#include "vpce/status.h"

namespace vpce {

class Communicator {
 public:
  virtual ~Communicator() = default;

  // This rank's index in [0, size()) and the number of ranks in the group.
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Collective. Gathers `bytes` bytes from `send` of every rank into `recv`, which holds
  // size() * bytes bytes afterwards, rank 0's first. Every rank of the group must call it;
  // all must pass the same `bytes`. A backend that can detect a disagreement in `bytes`
  // returns kInvalidUsage on every rank rather than undefined behaviour; one that sees a
  // rank fail to arrive returns kTimeout or kRemoteError rather than waiting forever.
  // `send` and `recv` must not overlap.
  virtual Status all_gather(const void* send, void* recv, std::size_t bytes) = 0;

  // Collective, for device tensors: the same gather of `bytes` from `send` into `recv`, both
  // device memory, issued on `stream` (a cudaStream_t) without waiting for it. Backends that
  // gather host memory only (threads, MPI) keep this default, which refuses.
  virtual Status device_all_gather(const void* send, void* recv, std::size_t bytes, void* stream) {
    static_cast<void>(send);
    static_cast<void>(recv);
    static_cast<void>(bytes);
    static_cast<void>(stream);
    return {Code::kUnsupported, std::string("comm: expected a backend that gathers device memory (NCCL) for device "
                                            "tensors, got ") +
                                    name()};
  }

  // A short name for messages: "threads", "mpi", "nccl", ...
  virtual const char* name() const = 0;
};

}  // namespace vpce
