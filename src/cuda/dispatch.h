// cuda/dispatch.h: the device path of forward() and backward(), as plain C++ (no CUDA
// headers), for src/loss/ and src/head/. Defined in cuda/dispatch.cu, or by
// cuda/without_cuda.cc in builds without CUDA (where device_supported() already refused).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "../common/token_math.h"
#include "../cpu/kernels.h"
#include "../protocol.h"
#include "../validate.h"
#include "vpce/communicator.h"

namespace vpce::detail {

// The RL outputs (src/rl/) of a device forward, in place of the loss's (wanted: the forward is
// theirs), each a device vector of one per token or absent; and the upstream gradients and
// E_p[z] of their backward.
struct PolicyForwardOutputs {
  bool wanted = false;
  TokenVector log_prob, entropy, lse, mean_logit, sum_p_squared;
};
struct PolicyBackwardInputs {
  bool wanted = false;
  TokenVector grad_log_prob, grad_entropy, mean_logit;
};

struct DeviceForwardArgs {
  LossInputs in;        // validated on the host (no values read)
  LossOutputs out;      // device memory
  RankHeader header;    // this rank's, as the host filled it
  Status local;         // this rank's own argument check: it still joins the gather if bad
  std::size_t payload;  // bytes per rank
  int64_t tokens;
  int64_t width;
  int64_t vocab_begin;
  LossParams params;
  LossOptions options;  // options.stream
  int device;           // the CUDA device of every tensor
  PolicyForwardOutputs policy = {};
};

// `state` holds the device workspace (created on first use).
Status device_forward(Communicator& comm, const DeviceForwardArgs& args, std::shared_ptr<void>* state);

// The error the device found in the last forward with this workspace state (waits for it).
Status device_status(void* state);

// For the fused head's device path (head/cuda/), which runs the forward's protocol steps
// itself (cuda/device.h's kernels, one gather per chunk): `state`'s protocol buffers for a
// call on `stream` (created on first use, ordered after the last forward that used them,
// grown for `ranks` payloads of `payload` bytes and `merged_bytes` of merged statistics and
// loss terms; not while the stream is captured), the error word cleared, and the call
// recorded, so that device_status() reads its last gather (every gather of the call must
// carry `payload` bytes). `device` is made current for the call and restored.
class CallOrder;  // (cuda/host.h)
struct DeviceProtocol {
  char* send = nullptr;        // payload bytes: this rank's header, then its [n, W] stats
  char* recv = nullptr;        // ranks * payload bytes
  char* merged = nullptr;      // merged_bytes
  char* error = nullptr;       // a cuda::DeviceError
  CallOrder* order = nullptr;  // the caller marks its call's end in it (a CallScope)
};
Status device_protocol(std::shared_ptr<void>* state, int device, void* stream, int ranks, int self, std::size_t payload,
                       std::size_t merged_bytes, DeviceProtocol* out);

struct DeviceBackwardArgs {
  LossInputs in;
  TokenVector lse;
  TokenVector grad_loss;
  RowMatrix grad;
  int64_t vocab_begin;
  LossParams params;
  LossOptions options;
  int device;
  PolicyBackwardInputs policy = {};  // (grad_loss unused when wanted)
};
Status device_backward(const DeviceBackwardArgs& args);

}  // namespace vpce::detail
