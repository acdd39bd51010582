// bindings/python/src/mapped_buffers.h: CPU buffers for new gradients, each an anonymous
// mapping of its own, reused when freed (see mapped_buffers.cc).
#pragma once

#include <cstddef>

namespace vpce::python {

// A buffer of `bytes` (> 0) bytes on 2 MiB boundaries, advised onto transparent huge pages
// before anything touches it; null if the mapping fails. Give it back with release().
void* acquire_mapped_buffer(std::size_t bytes);
void release_mapped_buffer(void* data) noexcept;

// The free mappings kept for reuse: how many, and their bytes (for the tests).
std::size_t kept_mapped_buffers();
std::size_t kept_mapped_bytes();

}  // namespace vpce::python
