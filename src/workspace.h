// workspace.h: what a vpce::Workspace holds (its definition is private to the library), for
// the forward (forward.cc), the fused head (head/) and their device paths.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "vpce/loss.h"

namespace vpce {

struct Workspace::Buffers {
  std::vector<std::byte> send;    // this rank's payload: header + [N, W] stats
  std::vector<std::byte> recv;    // every rank's payload, rank order
  std::vector<std::byte> merged;  // [N, W] merged stats
  std::vector<float> head;        // the fused head's tiles and fp32 staging (head/)
  std::shared_ptr<void> device;       // the device buffers, for device tensors (cuda/dispatch.cu)
  std::shared_ptr<void> device_head;  // the fused head's device buffers (head/cuda/)
};

struct WorkspaceAccess {
  static Workspace::Buffers* buffers(Workspace& w) { return w.buffers_.get(); }
};

}  // namespace vpce
