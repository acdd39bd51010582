// workspace.cc: vpce::Workspace, the scratch memory every operation's forward keeps between
// calls (workspace.h), and its asynchronous device error.
#include "workspace.h"

#include "cuda/dispatch.h"

namespace vpce {

Workspace::Workspace() : buffers_(std::make_unique<Buffers>()) {}
Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;

Status Workspace::device_status() {
  detail::WorkspaceLease lease(this);
  if (!lease.status().ok()) return lease.status();
  return detail::device_status(lease.buffers()->device.get());
}

std::size_t Workspace::capacity() const {
  if (!buffers_) return 0;
  return buffers_->send.capacity() + buffers_->recv.capacity() + buffers_->merged.capacity() +
         buffers_->head_tiles.bytes() + buffers_->head_logits.bytes();
}

}  // namespace vpce
