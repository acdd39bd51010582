// cuda/dispatch.h: the device path of forward() and backward(), as plain C++ (no CUDA
// headers), for src/forward.cc and src/loss.cc. Defined in cuda/dispatch.cu, or by
// device_cpu_only.cc in builds without CUDA (where device_supported() already refused).
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
};

// `state` holds the device workspace (created on first use).
Status device_forward(Communicator& comm, const DeviceForwardArgs& args, std::shared_ptr<void>* state);

// The error the device found in the last forward with this workspace state (waits for it).
Status device_status(void* state);

struct DeviceBackwardArgs {
  LossInputs in;
  TokenVector lse;
  TokenVector grad_loss;
  RowMatrix grad;
  int64_t vocab_begin;
  LossParams params;
  LossOptions options;
  int device;
};
Status device_backward(const DeviceBackwardArgs& args);

}  // namespace vpce::detail
