// workspace.h: what a vpce::Workspace holds (its definition is private to the library), for
// the forward (loss/forward.cc), the fused head (head/) and their device paths.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
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
  std::atomic<bool> in_use{false};    // held by a call (WorkspaceLease)
};

struct WorkspaceAccess {
  // (A moved-from workspace has none: it gets new ones, as a new workspace would, under one
  // lock, so that two calls that both find none make one set, and the lease then refuses one.)
  static Workspace::Buffers* buffers(Workspace& w) {
    static std::mutex creating;
    const std::lock_guard<std::mutex> lock(creating);
    if (!w.buffers_) w.buffers_ = std::make_unique<Workspace::Buffers>();
    return w.buffers_.get();
  }
};

namespace detail {

// One call's hold on a Workspace, for the host call's duration: the workspace's buffers, or,
// where the caller gave none or another call holds them (one call at a time on a Workspace:
// two threads, or two ranks of one group, given the same one), buffers of the lease's own. In
// the second case status() is the error; a call with a collective reports it through the
// collective, so that every rank of its group returns it and none waits (a call of another
// group holding the workspace runs on). Device calls are not covered: their work outlives the
// host call (vpce/workspace.h).
class WorkspaceLease {
 public:
  explicit WorkspaceLease(Workspace* workspace) {
    if (workspace != nullptr) {
      Workspace::Buffers* shared = WorkspaceAccess::buffers(*workspace);
      if (!shared->in_use.exchange(true, std::memory_order_acquire)) {
        held_ = shared;
        return;
      }
      status_ = {Code::kInvalidArgument,
                 "workspace: expected a Workspace no other call is using (one call at a time on a Workspace: one "
                 "per rank and thread), got one another call holds"};
    }
    own_.emplace();
  }
  ~WorkspaceLease() {
    if (held_ != nullptr) held_->in_use.store(false, std::memory_order_release);
  }
  WorkspaceLease(const WorkspaceLease&) = delete;
  WorkspaceLease& operator=(const WorkspaceLease&) = delete;

  Workspace::Buffers* buffers() { return held_ != nullptr ? held_ : WorkspaceAccess::buffers(*own_); }
  const Status& status() const { return status_; }

 private:
  Workspace::Buffers* held_ = nullptr;
  std::optional<Workspace> own_;
  Status status_;
};

}  // namespace detail
}  // namespace vpce
