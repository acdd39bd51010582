// workspace.h: what a vpce::Workspace holds (its definition is private to the library), for
// the forward (loss/forward.cc), the fused head (head/) and their device paths.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "vpce/workspace.h"

namespace vpce {
namespace detail {

// Floats kept between calls: grown, never shrunk, and never zeroed, so that a call that finds
// them large enough neither allocates nor touches fresh pages (for the fused head's buffers
// of tens of MiB, page faults and zeroing cost a few per cent of a step).
class HostFloats {
 public:
  // At least n floats (their values unspecified); throws std::bad_alloc.
  float* reserve(std::size_t n) {
    if (n > size_) {
      data_.reset();
      size_ = 0;  // so that a failed allocation leaves it empty, not a stale size
      data_.reset(new float[n]);
      size_ = n;
    }
    return data_.get();
  }
  std::size_t bytes() const { return size_ * sizeof(float); }

 private:
  std::unique_ptr<float[]> data_;
  std::size_t size_ = 0;
};

}  // namespace detail

struct Workspace::Buffers {
  std::vector<std::byte> send;        // this rank's payload: header + [N, W] stats
  std::vector<std::byte> recv;        // every rank's payload, rank order
  std::vector<std::byte> merged;      // [N, W] merged stats
  std::vector<int64_t> rank_columns;  // each rank's valid columns, from the headers (label smoothing)
  // The fused head's (head/tiles.cc): its tiles (the forward's per-thread tiles, then the
  // backward's logit gradients: one buffer for both), and the chunked mode's chunk of logits.
  detail::HostFloats head_tiles;
  detail::HostFloats head_logits;
  std::shared_ptr<void> device;       // the device buffers, for device tensors (cuda/dispatch.cu)
  std::shared_ptr<void> device_head;  // the fused head's device buffers (head/cuda/)
};

struct WorkspaceAccess {
  // (A moved-from workspace has none: it gets new ones, as a new workspace would.)
  static Workspace::Buffers* buffers(Workspace& w) {
    if (!w.buffers_) w.buffers_ = std::make_unique<Workspace::Buffers>();
    return w.buffers_.get();
  }
};

}  // namespace vpce
