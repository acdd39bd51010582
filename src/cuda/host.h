// cuda/host.h: host-side pieces shared by the loss's device code (dispatch.cu) and the fused
// head's (head/cuda/device_head.cc): CUDA errors as Status, the current device for a scope,
// whether a stream is being captured, and the order between calls that share a workspace's
// device buffers from different streams.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "vpce/status.h"

namespace vpce::detail {

inline Status cuda_failure(const char* what, cudaError_t e) {
  return {Code::kSystemError, std::string("cuda: ") + what + ": " + cudaGetErrorString(e)};
}

// Makes `device` current for its lifetime (kernels, allocations and NCCL calls go to the
// current device), restoring the caller's afterwards.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
  }
  ~CurrentDevice() {
    if (previous_ >= 0 && status_ == cudaSuccess) cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  // Whether the device could be made current.
  Status status() const { return status_ == cudaSuccess ? Status{} : cuda_failure("cudaSetDevice", status_); }

 private:
  int previous_ = 0;
  cudaError_t status_ = cudaSuccess;
};

inline Status is_capturing(cudaStream_t stream, bool* out) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (const cudaError_t e = cudaStreamIsCapturing(stream, &status); e != cudaSuccess) {
    return cuda_failure("cudaStreamIsCapturing", e);
  }
  *out = status != cudaStreamCaptureStatusNone;
  return {};
}

// The end of the last call that ran (was not captured into a graph) on a workspace's device
// buffers, as an event. A call on another stream waits for it on the device. While the
// stream is being captured, where a plain wait on work outside the capture is not allowed
// (and no event may be queried in global mode), the wait goes into the graph as an external
// event node (cudaEventWaitExternal), so each replay waits for the last call that ran before
// it: the torch.cuda.graph recipe, warm-up on one stream and capture on another, is ordered.
// An event, unlike a stream, stays valid when the stream it was recorded on is destroyed;
// graphs captured with it must not outlive the workspace (they use its buffers anyway).
class CallOrder {
 public:
  CallOrder() = default;
  CallOrder(const CallOrder&) = delete;
  CallOrder& operator=(const CallOrder&) = delete;
  ~CallOrder() {
    if (done_ != nullptr) cudaEventDestroy(done_);
  }

  // Before a call's work on `stream` (captured or not).
  Status before(cudaStream_t stream) const {
    if (!pending_) return {};
    bool captured = false;
    if (Status s = is_capturing(stream, &captured); !s.ok()) return s;
    if (captured && stream == stream_) return {};  // (replays on that stream follow it)
    if (const cudaError_t e =
            cudaStreamWaitEvent(stream, done_, captured ? cudaEventWaitExternal : cudaEventWaitDefault);
        e != cudaSuccess) {
      return cuda_failure("ordering after the previous call", e);
    }
    return {};
  }

  // After a call's work is queued on `stream`: a captured call leaves the last one that
  // ran. (Errors are dropped and cleared: the call has already returned its status.)
  void end(cudaStream_t stream) {
    bool captured = false;
    if (!is_capturing(stream, &captured).ok()) {
      cudaGetLastError();
      return;
    }
    if (captured) return;
    if (done_ == nullptr && cudaEventCreateWithFlags(&done_, cudaEventDisableTiming) != cudaSuccess) done_ = nullptr;
    pending_ = done_ != nullptr && cudaEventRecord(done_, stream) == cudaSuccess;
    if (!pending_) cudaGetLastError();
    stream_ = stream;
  }

  // Waits on the host for the last call that ran, for a destructor (errors dropped, and
  // cleared so that no later launch reports them).
  void wait() const {
    if (pending_ && cudaEventSynchronize(done_) != cudaSuccess) cudaGetLastError();
  }

 private:
  cudaEvent_t done_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool pending_ = false;  // done_ marks the end of a call
};

// Marks the end of a call on `stream` in `order` when it leaves scope, whichever way the
// call returns (its work is queued by then).
class CallScope {
 public:
  CallScope(CallOrder& order, cudaStream_t stream) : order_(order), stream_(stream) {}
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  ~CallScope() { order_.end(stream_); }

 private:
  CallOrder& order_;
  cudaStream_t stream_;
};

}  // namespace vpce::detail
