// vpce/nccl.h: the NCCL backend: a tensor-parallel group of GPUs is an NCCL communicator.
//
// Built with CUDA (-DVPCE_WITH_CUDA, the default when nvcc is found); link vpce::nccl.
//
//   std::unique_ptr<vpce::NcclCommunicator> comm;
//   vpce::Status s = vpce::NcclCommunicator::create(nccl_comm, &comm);  // not collective
//   options.stream = stream;                                           // a cudaStream_t
//   s = vpce::forward(*comm, logits, targets, shard, options, loss, lse, {}, &workspace);
//   s = vpce::backward(logits, targets, lse, grad_loss, shard, options, grad_logits);
//   s = workspace.device_status();  // when you want the device's verdict (waits)
//
// The forward's one collective is an ncclAllGather on options.stream, so the forward can be
// captured in a CUDA graph. The communicator is the caller's: vpce never creates, aborts or
// destroys it. NCCL cannot tell ranks that pass different sizes apart from a hang, so the
// number of tokens must agree across ranks (everything else is checked: docs/cuda.md).
#pragma once

#include <nccl.h>

#include <memory>

#include "vpce/communicator.h"
#include "vpce/status.h"

namespace vpce {

class NcclCommunicator final : public Communicator {
 public:
  // Wraps `comm` (not owned; it must outlive this object). Not collective.
  static Status create(ncclComm_t comm, std::unique_ptr<NcclCommunicator>* out);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "nccl"; }
  // Host memory: refused (NCCL gathers device memory).
  Status all_gather(const void* send, void* recv, std::size_t bytes) override;
  // ncclAllGather of `bytes` on `stream`, without waiting for it.
  Status device_all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override;

 private:
  NcclCommunicator(ncclComm_t comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  ncclComm_t comm_;
  int rank_;
  int size_;
};

}  // namespace vpce
