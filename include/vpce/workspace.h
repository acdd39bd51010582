// vpce/workspace.h: the scratch memory a forward keeps between calls (host buffers, and
// the device buffers and asynchronous error of device tensors), shared by every operation.
#pragma once

#include <cstddef>
#include <memory>

#include "vpce/status.h"

namespace vpce {

// Scratch memory for the forwards (forward(), the fused head's), kept between calls so that the hot path does not
// allocate once it has grown to the largest size seen. One per rank, used by one call at a time:
// a call on host tensors that finds another holding it (two threads, or two ranks of one
// group, given the same Workspace) leaves its buffers alone and is refused with
// kInvalidArgument naming the workspace (the group's other ranks return it as kRemoteError, and
// none waits); a call of another group holding it runs on. Device calls are not covered: their
// work outlives the host call, so ranks of one group given one Workspace may not overlap on the
// host, and the second's buffers are the first's (give each rank its own; they may hang).
// Moving or destroying a Workspace a call holds is undefined behaviour, as for any object. Any
// operation and any shape may follow another on it.
class Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(Workspace&&) noexcept;  // the moved-from one is empty, and usable as a new one
  Workspace& operator=(Workspace&&) noexcept;
  // Bytes currently held (host memory).
  std::size_t capacity() const;

  // Device tensors: errors only the device can see (a target out of range on some rank,
  // ranks that disagree) are asynchronous, as CUDA's own are: forward() returns success,
  // the outputs are NaN, and this call, which waits for the stream of the last forward that
  // used this workspace, returns the error (the same on every rank). Success on the CPU;
  // kInvalidArgument while a call holds the workspace.
  Status device_status();

  struct Buffers;  // opaque

 private:
  friend struct WorkspaceAccess;
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace vpce
