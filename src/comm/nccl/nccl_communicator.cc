// nccl_communicator.cc: the forward's one collective as an ncclAllGather on the caller's
// stream (see vpce/nccl.h).
#include "vpce/nccl.h"

#include <cuda_runtime.h>

#include <string>

namespace vpce {
namespace {

Status nccl_failure(const char* call, ncclResult_t result) {
  return {Code::kRemoteError, std::string("nccl: ") + call + " failed: " + ncclGetErrorString(result)};
}

}  // namespace

Status NcclCommunicator::create(ncclComm_t comm, std::unique_ptr<NcclCommunicator>* out) {
  if (out == nullptr) return {Code::kInvalidArgument, "out: expected a non-null pointer, got null"};
  out->reset();
  if (comm == nullptr) return {Code::kInvalidArgument, "comm: expected an NCCL communicator, got null"};
  int rank = 0;
  int size = 0;
  if (const ncclResult_t r = ncclCommUserRank(comm, &rank); r != ncclSuccess)
    return nccl_failure("ncclCommUserRank", r);
  if (const ncclResult_t r = ncclCommCount(comm, &size); r != ncclSuccess) return nccl_failure("ncclCommCount", r);
  out->reset(new NcclCommunicator(comm, rank, size));
  return {};
}

Status NcclCommunicator::all_gather(const void*, void*, std::size_t) {
  return {Code::kUnsupported,
          "comm: expected device tensors with the NCCL backend (it gathers device memory), got host tensors"};
}

Status NcclCommunicator::device_all_gather(const void* send, void* recv, std::size_t bytes, void* stream) {
  ncclResult_t r = ncclAllGather(send, recv, bytes, ncclUint8, comm_, static_cast<cudaStream_t>(stream));
  // A non-blocking communicator may still be enqueuing the call: wait for that (on the host;
  // the gather itself stays asynchronous on the stream), as NCCL's documentation says.
  while (r == ncclInProgress) {
    if (const ncclResult_t e = ncclCommGetAsyncError(comm_, &r); e != ncclSuccess) r = e;
  }
  if (r != ncclSuccess) return nccl_failure("ncclAllGather", r);
  return {};
}

}  // namespace vpce
