// bindings/python/src/arguments.cc: see arguments.h.
#include "arguments.h"

#include <cstdio>
#include <cstring>

namespace vpce::python {
namespace {

// A group's error reads "rank r of R: <code>: ..." on every rank, its code the failing
// rank's own there and kRemoteError elsewhere: raised as that text alone, the same on every
// rank. Any other error as "<code>: <message>".
bool is_group_error(const std::string& message) {
  int rank = 0, ranks = 0, consumed = 0;
  return std::sscanf(message.c_str(), "rank %d of %d: %n", &rank, &ranks, &consumed) == 2 && consumed > 0;
}

template <class A>
vpce::TensorView make_view(const A& a, const char* name) {
  if (a.ndim() > static_cast<size_t>(vpce::TensorView::kMaxDims)) {
    throw StatusError(std::string("invalid argument: ") + name + ".ndim: expected at most " +
                      std::to_string(vpce::TensorView::kMaxDims) + ", got " + std::to_string(a.ndim()));
  }
  vpce::TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.device = {static_cast<vpce::DeviceType>(a.device_type()), a.device_id()};
  v.ndim = static_cast<int32_t>(a.ndim());
  const nb::dlpack::dtype t = a.dtype();
  v.dtype = {static_cast<vpce::TypeCode>(t.code), t.bits, t.lanes};
  for (size_t d = 0; d < a.ndim(); ++d) {
    v.shape[d] = static_cast<int64_t>(a.shape(d));
    v.strides[d] = a.stride(d);
  }
  return v;
}

// str(value), as std::string.
std::string text_of(nb::handle value) {
  const nb::object text = nb::steal(PyObject_Str(value.ptr()));
  if (!text.is_valid()) throw nb::python_error();
  return nb::cast<std::string>(text);
}

// Whether `value` offers a buffer, but only a read-only one.
bool read_only_buffer(nb::handle value) {
  if (!PyObject_CheckBuffer(value.ptr())) return false;
  Py_buffer buffer;
  if (PyObject_GetBuffer(value.ptr(), &buffer, PyBUF_WRITABLE) == 0) {
    PyBuffer_Release(&buffer);
    return false;
  }
  PyErr_Clear();
  return true;
}

// What an argument that nanobind could not take as an array is, for the message: its type,
// the dtype, device and layout it reports, and why it is refused (read-only, or what its
// own DLPack export raises: bool, meta, sparse, big-endian, ...).
std::string describe_array(nb::handle value, bool writable) {
  try {
    std::string text = (value.is_none() ? std::string("None") : "a " + value_type_name(value));
    std::string traits;
    for (const char* attribute : {"dtype", "device", "layout"}) {
      if (!nb::hasattr(value, attribute)) continue;
      traits += (traits.empty() ? "" : ", ") + std::string(attribute) + " " + text_of(nb::getattr(value, attribute));
    }
    if (!traits.empty()) text += " (" + traits + ")";
    if (writable && read_only_buffer(value)) return text + " that is read-only";
    if (nb::hasattr(value, "__dlpack__")) {
      try {
        value.attr("__dlpack__")();
      } catch (nb::python_error& e) {
        return text + " whose DLPack export fails: " + value_type_name(e.value()) + ": " + text_of(e.value());
      }
    }
    return text;
  } catch (nb::python_error&) {
    return "a " + std::string(Py_TYPE(value.ptr())->tp_name);
  }
}

// still exports it, e.g. an array made from it: that one keeps the bytearray alive).
struct ReleasedView {
  explicit ReleasedView(const nb::object& bytearray) : view(nb::steal(PyMemoryView_FromObject(bytearray.ptr()))) {
    if (!view.is_valid()) throw nb::python_error();
  }
  ~ReleasedView() {
    PyObject* result = PyObject_CallMethod(view.ptr(), "release", nullptr);
    if (result == nullptr) PyErr_Clear();
    Py_XDECREF(result);
  }
  ReleasedView(const ReleasedView&) = delete;
  ReleasedView& operator=(const ReleasedView&) = delete;

  nb::object view;
};

}  // namespace

void check(const vpce::Status& status) {
  if (status.ok()) return;
  throw StatusError(is_group_error(status.message()) ? status.message() : status.to_string());
}

vpce::TensorView view_of(const nb::ndarray<nb::ro>& a, const char* name) { return make_view(a, name); }
vpce::TensorView view_of(const nb::ndarray<>& a, const char* name) { return make_view(a, name); }

// An argument as an array (no copy), or TypeError naming it, what was expected and what it is.
template <class A>
A as_array(nb::handle value, const char* name) {
  constexpr bool writable = std::is_same_v<A, MutableArray>;
  A array;
  if (!value.is_none() && nb::try_cast(value, array, /*convert=*/false)) return array;
  throw nb::type_error((std::string(name) + ": expected " + (writable ? "a writable" : "an") +
                        " array that exports through DLPack or the buffer protocol (NumPy, PyTorch, JAX, CuPy; "
                        "dense, native byte order), got " +
                        describe_array(value, writable))
                           .c_str());
}
template Array as_array<Array>(nb::handle, const char*);
template MutableArray as_array<MutableArray>(nb::handle, const char*);

// A Python type as "module.qualname" (numpy.ndarray, torch.Tensor, vpce._vpce.Reduction).
std::string qualified_name(nb::handle type) {
  const std::string module = text_of(nb::getattr(type, "__module__", nb::str("")));
  const std::string name = text_of(nb::getattr(type, "__qualname__", nb::str("?")));
  return module.empty() || module == "builtins" ? name : module + "." + name;
}

std::string value_type_name(nb::handle value) { return qualified_name(value.type()); }

std::string short_repr(nb::handle value) {
  const nb::object repr = nb::steal(PyObject_Repr(value.ptr()));
  if (!repr.is_valid()) throw nb::python_error();
  std::string text = nb::cast<std::string>(repr);
  return text.size() > 80 ? text.substr(0, 77) + "..." : text;
}

bool is_boolean(nb::handle value) {
  if (PyBool_Check(value.ptr())) return true;
  if (!nb::hasattr(value, "dtype")) return false;
  const nb::object text = nb::steal(PyObject_Str(value.attr("dtype").ptr()));
  if (!text.is_valid()) {
    PyErr_Clear();
    return false;
  }
  const char* dtype = PyUnicode_AsUTF8(text.ptr());
  if (dtype == nullptr) {
    PyErr_Clear();
    return false;
  }
  return std::strcmp(dtype, "bool") == 0 || std::strcmp(dtype, "torch.bool") == 0;
}

vpce::Status CallbackCommunicator::all_gather(const void* send, void* recv, std::size_t bytes) {
  if (all_gather_.is_none()) {  // one rank: the gather is a copy
    if (bytes > 0) std::memcpy(recv, send, bytes);
    return {};
  }
  nb::gil_scoped_acquire gil;
  try {
    // The callable sees Python-owned copies: views (or arrays over them) that it keeps past
    // the call hold memory of their own, never vpce's buffers, which forward() frees.
    const auto send_bytes = static_cast<Py_ssize_t>(bytes);
    const Py_ssize_t recv_bytes = send_bytes * size_;
    const nb::object send_copy = nb::steal(PyByteArray_FromStringAndSize(static_cast<const char*>(send), send_bytes));
    const nb::object recv_copy = nb::steal(PyByteArray_FromStringAndSize(nullptr, recv_bytes));
    if (!send_copy.is_valid() || !recv_copy.is_valid()) throw nb::python_error();
    std::memset(PyByteArray_AS_STRING(recv_copy.ptr()), 0, static_cast<std::size_t>(recv_bytes));
    const ReleasedView send_view(send_copy);
    const ReleasedView recv_view(recv_copy);
    all_gather_(send_view.view, recv_view.view);
    // recv_view still exports recv_copy, so its size cannot have changed.
    if (recv_bytes > 0) std::memcpy(recv, PyByteArray_AS_STRING(recv_copy.ptr()), static_cast<std::size_t>(recv_bytes));
    return {};
  } catch (nb::python_error& e) {
    raised_.emplace(std::move(e));
    return {vpce::Code::kRemoteError, "all_gather: the Python collective raised an exception"};
  }
}

void CallbackCommunicator::check_call(const vpce::Status& status) {
  if (raised_) {
    nb::python_error e = std::move(*raised_);
    raised_.reset();
    throw e;
  }
  check(status);
}

void require_all_gather(int size, const nb::object& all_gather) {
  if (size > 1 && all_gather.is_none()) {
    throw StatusError("invalid argument: all_gather: expected a callable for a group of " + std::to_string(size) +
                      " ranks, got None");
  }
}

}  // namespace vpce::python
