// bindings/python/src/module.cc: the vpce._vpce extension (nanobind): the module, its error
// type and what serves every operation; each operation's functions in <operation>_bindings.cc.
//
// Exposes the one-call and staged APIs over any DLPack tensor (PyTorch, NumPy, JAX, CuPy):
// arguments are nb::ndarray, turned into vpce::TensorView without a copy. It never links
// libtorch, so one build serves every PyTorch version. The forward's one collective is a
// Python callable all_gather(send, recv) given writable memoryviews (send: this rank's
// payload; recv: size x payload bytes, rank 0's first), so that the framework's own
// process group carries it; the views are of Python-owned copies, released when the callable
// returns, so a callable that keeps them never reaches vpce's buffers. The GIL is released
// while the kernels run and taken again only for that callable. A vpce error raises
// vpce.Error ("invalid argument: targets: ..."); an argument that is no array, or an option
// of the wrong type or range, raises TypeError or ValueError naming it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <tuple>

#include "arguments.h"
#include "mapped_buffers.h"
#include "vpce/version.h"

namespace nb = nanobind;
using vpce::python::StatusError;

NB_MODULE(_vpce, m) {
  m.doc() = "vpce: exact vocab-parallel cross-entropy (C++ kernels over DLPack tensors)";
  m.attr("__version__") = VPCE_VERSION_STRING;
  m.attr("WITH_HEAD") = static_cast<bool>(VPCE_WITH_HEAD);
  nb::exception<StatusError>(m, "Error", PyExc_RuntimeError);

  // A CPU buffer for a new gradient: a uint8 array of `bytes` on 2 MiB boundaries, a mapping
  // of its own advised onto huge pages, reused for the next buffer of its size once the
  // array (and every tensor over it) is freed (bindings/python/src/mapped_buffers.cc).
  m.def("cpu_kernel_target", &vpce::cpu_kernel_target);
  m.def(
      "gradient_buffer",
      [](std::size_t bytes) {
        if (bytes == 0) throw nb::value_error("bytes: expected a size > 0, got 0");
        void* data = vpce::python::acquire_mapped_buffer(bytes);
        if (data == nullptr) throw std::bad_alloc();
        nb::capsule owner(data, [](void* p) noexcept { vpce::python::release_mapped_buffer(p); });
        return nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>(data, {bytes}, owner);
      },
      nb::arg("bytes"));
  m.def(
      "kept_gradient_buffers",
      [] { return std::make_tuple(vpce::python::kept_mapped_buffers(), vpce::python::kept_mapped_bytes()); },
      "(count, bytes) of the freed gradient buffers kept for reuse.");

  vpce::python::bind_loss(m);
  vpce::python::bind_head(m);
  vpce::python::bind_rows(m);
  vpce::python::bind_rl(m);
}
