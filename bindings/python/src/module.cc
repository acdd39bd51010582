// bindings/python/src/module.cc: the vpce._vpce extension (nanobind).
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
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <type_traits>

#include "mapped_buffers.h"
#include "vpce/head.h"
#include "vpce/version.h"
#include "vpce/vpce.h"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::ro>;   // any dtype, device, layout; read through
using MutableArray = nb::ndarray<>;  // written through

struct StatusError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A group's error reads "rank r of R: <code>: ..." on every rank, its code the failing
// rank's own there and kRemoteError elsewhere: raised as that text alone, the same on every
// rank. Any other error as "<code>: <message>".
bool is_group_error(const std::string& message) {
  int rank = 0, ranks = 0, consumed = 0;
  return std::sscanf(message.c_str(), "rank %d of %d: %n", &rank, &ranks, &consumed) == 2 && consumed > 0;
}

void check(const vpce::Status& status) {
  if (status.ok()) return;
  throw StatusError(is_group_error(status.message()) ? status.message() : status.to_string());
}

template <class A>
vpce::TensorView view(const A& a, const char* name) {
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

template <class A>
std::optional<A> optional_array(nb::handle value, const char* name) {
  if (value.is_none()) return std::nullopt;
  return as_array<A>(value, name);
}

template <class A>
std::optional<vpce::TensorView> optional_view(const std::optional<A>& a, const char* name) {
  if (!a) return std::nullopt;
  return view(*a, name);
}

// A LossOptions field's value from Python, converted as int() / float() would (an enum must
// be its vpce type), with TypeError or ValueError naming the field instead of nanobind's
// signature dump.
// A bool, or something holding one (a 0-d bool tensor or NumPy bool), which Python would
// let pass as the number 1 or 0: never a count, a class id or a weight here.
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

template <class T>
T option_value(nb::handle value, const char* name) {
  const std::string field = std::string("options.") + name;
  if constexpr (std::is_enum_v<T>) {
    T out{};
    if (!nb::try_cast(value, out, /*convert=*/false)) {
      throw nb::type_error(
          (field + ": expected a " + qualified_name(nb::type<T>()) + ", got " + short_repr(value)).c_str());
    }
    return out;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!PyBool_Check(value.ptr())) {
      throw nb::type_error(
          (field + ": expected a bool, got " + value_type_name(value) + " " + short_repr(value)).c_str());
    }
    return value.ptr() == Py_True;
  } else if constexpr (std::is_floating_point_v<T>) {
    const bool boolean = is_boolean(value);
    const double v = boolean ? -1.0 : PyFloat_AsDouble(value.ptr());
    if (boolean || (v == -1.0 && PyErr_Occurred())) {
      PyErr_Clear();
      throw nb::type_error(
          (field + ": expected a number, got " + value_type_name(value) + " " + short_repr(value)).c_str());
    }
    return static_cast<T>(v);
  } else {
    // A bool is an int to Python, but never a count or a class id here (True would be 1).
    const nb::object index = is_boolean(value) ? nb::object() : nb::steal(PyNumber_Index(value.ptr()));
    if (!index.is_valid()) {
      PyErr_Clear();
      throw nb::type_error(
          (field + ": expected an integer, got " + value_type_name(value) + " " + short_repr(value)).c_str());
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0 || v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
      throw nb::value_error((field + ": expected an integer in [" + std::to_string(std::numeric_limits<T>::min()) +
                             ", " + std::to_string(std::numeric_limits<T>::max()) + "], got " + short_repr(index))
                                .c_str());
    }
    return static_cast<T>(v);
  }
}

// An options class's fields as (name, member) pairs: a property each, whose setter checks
// the value (option_value), and pickling, copy and deepcopy (a module that holds one,
// torch.save) by name, read back through the same checks.
template <class Options, class... Types>
void def_fields(nb::class_<Options>& cls, std::pair<const char*, Types Options::*>... fields) {
  (cls.def_prop_rw(
       fields.first, [member = fields.second](const Options& o) { return o.*member; },
       [name = fields.first, member = fields.second](Options& o, std::optional<nb::object> value) {
         // optional: None gets the message too
         o.*member = option_value<Types>(value ? nb::handle(*value) : nb::none(), name);
       }),
   ...);
  cls.def("__getstate__", [fields...](const Options& o) {
    nb::dict state;
    ((state[fields.first] = o.*(fields.second)), ...);
    return state;
  });
  cls.def("__setstate__", [fields...](Options& o, const nb::dict& state) {
    new (&o) Options();
    auto read = [&](const char* name, auto& member) {
      if (!state.contains(name)) return;
      const nb::object value = state[name];
      member = option_value<std::remove_reference_t<decltype(member)>>(value, name);
    };
    (read(fields.first, o.*(fields.second)), ...);
  });
}

// The optional per-token tensors of a forward, as views that ForwardExtras points into
// (so the object must stay where it is while the call runs).
struct Extras {
  Extras(nb::handle weights, nb::handle target_is_argmax, nb::handle entropy)
      : weights_array(optional_array<Array>(weights, "weights")),
        argmax_array(optional_array<MutableArray>(target_is_argmax, "target_is_argmax")),
        entropy_array(optional_array<MutableArray>(entropy, "entropy")),
        w(optional_view(weights_array, "weights")),
        a(optional_view(argmax_array, "target_is_argmax")),
        h(optional_view(entropy_array, "entropy")) {
    views.weights = w ? &*w : nullptr;
    views.target_is_argmax = a ? &*a : nullptr;
    views.entropy = h ? &*h : nullptr;
  }
  Extras(const Extras&) = delete;
  Extras& operator=(const Extras&) = delete;

  std::optional<Array> weights_array;  // the imported arrays, alive while their views are used
  std::optional<MutableArray> argmax_array, entropy_array;
  std::optional<vpce::TensorView> w, a, h;
  vpce::ForwardExtras views;
};

// A writable memoryview of a bytearray, released when it goes out of scope, so that a
// callable that kept it gets ValueError on a late use (release is skipped while something
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

// The forward's collective through a Python callable (or a copy, for a single rank).
class CallbackCommunicator final : public vpce::Communicator {
 public:
  CallbackCommunicator(int rank, int size, nb::object all_gather)
      : rank_(rank), size_(size), all_gather_(std::move(all_gather)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "python"; }

  vpce::Status all_gather(const void* send, void* recv, std::size_t bytes) override {
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
      if (recv_bytes > 0)
        std::memcpy(recv, PyByteArray_AS_STRING(recv_copy.ptr()), static_cast<std::size_t>(recv_bytes));
      return {};
    } catch (nb::python_error& e) {
      raised_.emplace(std::move(e));
      return {vpce::Code::kRemoteError, "all_gather: the Python collective raised an exception"};
    }
  }

  // After the call (with the GIL): re-raises what the callable raised, as it was (its class,
  // KeyboardInterrupt and a framework's timeout too), rather than as a vpce.Error that
  // carries its traceback as text; else raises for a failed `status`.
  void check_call(const vpce::Status& status) {
    if (raised_) {
      nb::python_error e = std::move(*raised_);
      raised_.reset();
      throw e;
    }
    check(status);
  }

 private:
  int rank_;
  int size_;
  nb::object all_gather_;
  std::optional<nb::python_error> raised_;
};


// The fused head's operands, as views that HeadInputs points into (so the object must stay
// where it is while the call runs).
struct Head {
  Head(nb::handle hidden, nb::handle weight, nb::handle bias)
      : hidden_array(as_array<Array>(hidden, "hidden")),
        weight_array(as_array<Array>(weight, "weight")),
        bias_array(optional_array<Array>(bias, "bias")),
        b(optional_view(bias_array, "bias")) {
    inputs.hidden = view(hidden_array, "hidden");
    inputs.weight = view(weight_array, "weight");
    inputs.bias = b ? &*b : nullptr;
  }
  Head(const Head&) = delete;
  Head& operator=(const Head&) = delete;
  // The CPU head's buffers (tiles, a chunk of logits: tens of MiB), kept between the steps
  // on each calling thread, as PyTorch's caching allocator keeps its blocks: a step that
  // finds them large enough neither allocates nor faults in fresh pages. None on a device.
  vpce::Workspace* workspace() const {
    thread_local vpce::Workspace cpu_workspace;
    return inputs.hidden.device.type == vpce::DeviceType::kCPU ? &cpu_workspace : nullptr;
  }

  Array hidden_array, weight_array;
  std::optional<Array> bias_array;
  std::optional<vpce::TensorView> b;
  vpce::HeadInputs inputs;
};

// The gradients a head backward writes or adds into (each optional), as views that
// HeadGradients points into.
struct Gradients {
  Gradients(nb::handle hidden, nb::handle weight, nb::handle bias, bool accumulate_hidden, bool accumulate_weight,
            bool accumulate_bias)
      : hidden_array(optional_array<MutableArray>(hidden, "grad_hidden")),
        weight_array(optional_array<MutableArray>(weight, "grad_weight")),
        bias_array(optional_array<MutableArray>(bias, "grad_bias")),
        h(optional_view(hidden_array, "grad_hidden")),
        w(optional_view(weight_array, "grad_weight")),
        b(optional_view(bias_array, "grad_bias")) {
    views.hidden = {h ? &*h : nullptr, accumulate_hidden};
    views.weight = {w ? &*w : nullptr, accumulate_weight};
    views.bias = {b ? &*b : nullptr, accumulate_bias};
  }
  Gradients(const Gradients&) = delete;
  Gradients& operator=(const Gradients&) = delete;

  std::optional<MutableArray> hidden_array, weight_array, bias_array;
  std::optional<vpce::TensorView> h, w, b;
  vpce::HeadGradients views;
};

void require_all_gather(int size, const nb::object& all_gather) {
  if (size > 1 && all_gather.is_none()) {
    throw StatusError("invalid argument: all_gather: expected a callable for a group of " + std::to_string(size) +
                      " ranks, got None");
  }
}

vpce::VocabShard shard_of(int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size) {
  return {vocab_begin, vocab_end, vocab_size};
}

}  // namespace

NB_MODULE(_vpce, m) {
  m.doc() = "vpce: exact vocab-parallel cross-entropy (C++ kernels over DLPack tensors)";
  m.attr("__version__") = VPCE_VERSION_STRING;
  nb::exception<StatusError>(m, "Error", PyExc_RuntimeError);

  nb::enum_<vpce::Reduction>(m, "Reduction")
      .value("NONE", vpce::Reduction::kNone)
      .value("SUM", vpce::Reduction::kSum)
      .value("MEAN", vpce::Reduction::kMean);
  nb::enum_<vpce::SmoothingSemantics>(m, "SmoothingSemantics")
      .value("MEGATRON", vpce::SmoothingSemantics::kMegatron)
      .value("PYTORCH", vpce::SmoothingSemantics::kPyTorch);

  auto options = nb::class_<vpce::LossOptions>(m, "LossOptions", "Every loss option; see include/vpce/loss.h");
  options.def(nb::init<>());
  // (Not the CUDA stream, which Python does not set.)
  using Loss = vpce::LossOptions;
  def_fields(options, std::pair{"label_smoothing", &Loss::label_smoothing},
             std::pair{"smoothing_semantics", &Loss::smoothing_semantics}, std::pair{"ignore_index", &Loss::ignore_index},
             std::pair{"z_loss_weight", &Loss::z_loss_weight}, std::pair{"logit_scale", &Loss::logit_scale},
             std::pair{"softcap", &Loss::softcap}, std::pair{"valid_vocab_size", &Loss::valid_vocab_size},
             std::pair{"reduction", &Loss::reduction}, std::pair{"num_threads", &Loss::num_threads});

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
  m.def("kept_gradient_buffers",
        [] { return std::make_tuple(vpce::python::kept_mapped_buffers(), vpce::python::kept_mapped_bytes()); },
        "(count, bytes) of the freed gradient buffers kept for reuse.");

  // Row kernels for Megatron's static helpers (vpce/rows.h): CPU arrays [..., K] whose leading
  // dimensions collapse to one row stride, the last dimension contiguous.
  m.def(
      "row_max",
      [](nb::handle logits, nb::handle max, nb::handle widened, int num_threads) {
        const auto logits_array = as_array<Array>(logits, "logits");
        const auto max_array = as_array<MutableArray>(max, "max");
        const auto widened_array = optional_array<MutableArray>(widened, "widened");
        const vpce::TensorView x = view(logits_array, "logits");
        const vpce::TensorView m_view = view(max_array, "max");
        const auto w = optional_view(widened_array, "widened");
        nb::gil_scoped_release release;
        check(vpce::row_max(x, m_view, w ? &*w : nullptr, num_threads));
      },
      nb::arg("logits").none(), nb::arg("max").none(), nb::arg("widened").none() = nb::none(),
      nb::arg("num_threads") = 0,
      "max[...] <- each row's max of logits [..., K] (NaN-propagating); widened, when given, <- the logits as "
      "float32, in the same read.");
  m.def(
      "exp_rows_in_place",
      [](nb::handle x, nb::handle shift, nb::handle sums, int num_threads) {
        const auto x_array = as_array<MutableArray>(x, "x");
        const auto shift_array = as_array<Array>(shift, "shift");
        const auto sums_array = optional_array<MutableArray>(sums, "sums");
        const vpce::TensorView xv = view(x_array, "x");
        const vpce::TensorView s = view(shift_array, "shift");
        const auto sv = optional_view(sums_array, "sums");
        nb::gil_scoped_release release;
        check(vpce::exp_rows_in_place(xv, s, sv ? &*sv : nullptr, num_threads));
      },
      nb::arg("x").none(), nb::arg("shift").none(), nb::arg("sums").none() = nb::none(), nb::arg("num_threads") = 0,
      "x[i, v] <- exp(x[i, v] - shift[i]) in place (float32); sums, when given, <- each row's sum of the new x.");

  m.attr("STATS_WIDTH") = vpce::kStatsWidth;
  m.attr("STATS_WIDTH_WITH_EXTRAS") = vpce::kStatsWidthWithExtras;

  m.def(
      "forward",
      [](nb::handle logits, nb::handle targets, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::LossOptions& options, nb::handle loss, nb::handle lse, nb::handle weights,
         nb::handle target_is_argmax, nb::handle entropy, int rank, int size, nb::object all_gather) {
        if (size > 1 && all_gather.is_none()) {
          throw StatusError("invalid argument: all_gather: expected a callable for a group of " + std::to_string(size) +
                            " ranks, got None");
        }
        const auto logits_array = as_array<Array>(logits, "logits");
        const auto targets_array = as_array<Array>(targets, "targets");
        const auto loss_array = as_array<MutableArray>(loss, "loss");
        const auto lse_array = as_array<MutableArray>(lse, "lse");
        const vpce::TensorView x = view(logits_array, "logits");
        const vpce::TensorView y = view(targets_array, "targets");
        const vpce::TensorView l = view(loss_array, "loss");
        const vpce::TensorView e = view(lse_array, "lse");
        const Extras extras(weights, target_is_argmax, entropy);
        CallbackCommunicator comm(rank, size, std::move(all_gather));
        vpce::Status status;
        {
          nb::gil_scoped_release release;
          status = vpce::forward(comm, x, y, shard_of(vocab_begin, vocab_end, vocab_size), options, l, e, extras.views);
        }
        comm.check_call(status);
      },
      nb::arg("logits").none(), nb::arg("targets").none(), nb::arg("vocab_begin"), nb::arg("vocab_end"),
      nb::arg("vocab_size"), nb::arg("options"), nb::arg("loss").none(), nb::arg("lse").none(),
      nb::arg("weights").none() = nb::none(), nb::arg("target_is_argmax").none() = nb::none(),
      nb::arg("entropy").none() = nb::none(), nb::arg("rank") = 0, nb::arg("size") = 1,
      nb::arg("all_gather") = nb::none(),
      "One-call forward: local statistics, one all_gather(send, recv) through the callable, merge, loss.");

  m.def(
      "backward",
      [](nb::handle logits, nb::handle targets, nb::handle lse, nb::handle grad_loss, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, nb::handle grad_logits,
         nb::handle weights) {
        const auto logits_array = as_array<Array>(logits, "logits");
        const auto targets_array = as_array<Array>(targets, "targets");
        const auto lse_array = as_array<Array>(lse, "lse");
        const auto grad_loss_array = as_array<Array>(grad_loss, "grad_loss");
        const auto grad_logits_array = as_array<MutableArray>(grad_logits, "grad_logits");
        const auto weights_array = optional_array<Array>(weights, "weights");
        const vpce::TensorView x = view(logits_array, "logits");
        const vpce::TensorView y = view(targets_array, "targets");
        const vpce::TensorView e = view(lse_array, "lse");
        const vpce::TensorView g = view(grad_loss_array, "grad_loss");
        const vpce::TensorView out = view(grad_logits_array, "grad_logits");
        const auto w = optional_view(weights_array, "weights");
        nb::gil_scoped_release release;
        check(
            vpce::backward(x, y, e, g, shard_of(vocab_begin, vocab_end, vocab_size), options, out, w ? &*w : nullptr));
      },
      nb::arg("logits").none(), nb::arg("targets").none(), nb::arg("lse").none(), nb::arg("grad_loss").none(),
      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"),
      nb::arg("grad_logits").none(), nb::arg("weights").none() = nb::none(),
      "Backward: no collective; grad_logits may be the logits themselves (in place).");

  m.def(
      "calculate_local_stats",
      [](nb::handle logits, nb::handle targets, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::LossOptions& options, nb::handle stats) {
        const auto logits_array = as_array<Array>(logits, "logits");
        const auto targets_array = as_array<Array>(targets, "targets");
        const auto stats_array = as_array<MutableArray>(stats, "stats");
        const vpce::TensorView x = view(logits_array, "logits");
        const vpce::TensorView y = view(targets_array, "targets");
        const vpce::TensorView s = view(stats_array, "stats");
        nb::gil_scoped_release release;
        check(vpce::calculate_local_stats(x, y, shard_of(vocab_begin, vocab_end, vocab_size), options, s));
      },
      nb::arg("logits").none(), nb::arg("targets").none(), nb::arg("vocab_begin"), nb::arg("vocab_end"),
      nb::arg("vocab_size"), nb::arg("options"), nb::arg("stats").none(),
      "Staged 1: this rank's [N, 4] (or [N, 6]) float32 statistics.");

  m.def(
      "merge_stats",
      [](nb::handle gathered, const vpce::LossOptions& options, nb::handle stats,
         const std::vector<std::tuple<int64_t, int64_t, int64_t>>& shards) {
        const auto gathered_array = as_array<Array>(gathered, "gathered");
        const auto stats_array = as_array<MutableArray>(stats, "stats");
        const vpce::TensorView g = view(gathered_array, "gathered");
        const vpce::TensorView s = view(stats_array, "stats");
        std::vector<vpce::VocabShard> ranges;
        for (const auto& [begin, end, size] : shards) ranges.push_back(shard_of(begin, end, size));
        nb::gil_scoped_release release;
        check(vpce::merge_stats(g, options, s, ranges));
      },
      nb::arg("gathered").none(), nb::arg("options"), nb::arg("stats").none(),
      nb::arg("shards") = std::vector<std::tuple<int64_t, int64_t, int64_t>>{},
      "Staged 2: [R, N, W] -> [N, W], in rank order. shards: each rank's (vocab_begin, vocab_end, "
      "vocab_size), in rank order; needed with label smoothing when R > 1.");

  m.def(
      "calculate_loss",
      [](nb::handle stats, nb::handle targets, int64_t vocab_size, const vpce::LossOptions& options, nb::handle loss,
         nb::handle lse, nb::handle weights, nb::handle target_is_argmax, nb::handle entropy) {
        const auto stats_array = as_array<Array>(stats, "stats");
        const auto targets_array = as_array<Array>(targets, "targets");
        const auto loss_array = as_array<MutableArray>(loss, "loss");
        const auto lse_array = as_array<MutableArray>(lse, "lse");
        const vpce::TensorView s = view(stats_array, "stats");
        const vpce::TensorView y = view(targets_array, "targets");
        const vpce::TensorView l = view(loss_array, "loss");
        const vpce::TensorView e = view(lse_array, "lse");
        const Extras extras(weights, target_is_argmax, entropy);
        nb::gil_scoped_release release;
        check(vpce::calculate_loss(s, y, vocab_size, options, l, e, extras.views));
      },
      nb::arg("stats").none(), nb::arg("targets").none(), nb::arg("vocab_size"), nb::arg("options"),
      nb::arg("loss").none(), nb::arg("lse").none(), nb::arg("weights").none() = nb::none(),
      nb::arg("target_is_argmax").none() = nb::none(), nb::arg("entropy").none() = nb::none(),
      "Staged 3: merged statistics -> loss, lse and the extras.");

  // ---- the fused head (vpce/head.h): linear + cross-entropy without the logits ----------
  auto head = nb::class_<vpce::HeadOptions>(m, "HeadOptions",
                                            "Tile and chunk sizes, the gradients' precision; see include/vpce/head.h");
  head.def(nb::init<>());
  using HeadOpts = vpce::HeadOptions;
  def_fields(head, std::pair{"token_block", &HeadOpts::token_block}, std::pair{"vocab_block", &HeadOpts::vocab_block},
             std::pair{"chunk_tokens", &HeadOpts::chunk_tokens},
             std::pair{"bf16_logit_gradients", &HeadOpts::bf16_logit_gradients});

  m.def(
      "linear_cross_entropy_forward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, const vpce::HeadOptions& head_options,
         nb::handle loss, nb::handle lse, nb::handle weights, nb::handle target_is_argmax, nb::handle entropy, int rank,
         int size, nb::object all_gather) {
        require_all_gather(size, all_gather);
        const Head operands(hidden, weight, bias);
        const auto targets_array = as_array<Array>(targets, "targets");
        const auto loss_array = as_array<MutableArray>(loss, "loss");
        const auto lse_array = as_array<MutableArray>(lse, "lse");
        const vpce::TensorView y = view(targets_array, "targets");
        const vpce::TensorView l = view(loss_array, "loss");
        const vpce::TensorView e = view(lse_array, "lse");
        const Extras extras(weights, target_is_argmax, entropy);
        CallbackCommunicator comm(rank, size, std::move(all_gather));
        vpce::Status status;
        {
          nb::gil_scoped_release release;
          status = vpce::linear_cross_entropy_forward(comm, operands.inputs, y,
                                                      shard_of(vocab_begin, vocab_end, vocab_size), options,
                                                      head_options, l, e, extras.views, operands.workspace());
        }
        comm.check_call(status);
      },
      nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("targets").none(),
      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("head"),
      nb::arg("loss").none(), nb::arg("lse").none(), nb::arg("weights").none() = nb::none(),
      nb::arg("target_is_argmax").none() = nb::none(), nb::arg("entropy").none() = nb::none(), nb::arg("rank") = 0,
      nb::arg("size") = 1, nb::arg("all_gather") = nb::none(),
      "Fused head, recompute mode: the loss of hidden @ weight.T + bias without the logits; one "
      "all_gather(send, recv) through the callable. bias may be None.");

  m.def(
      "linear_cross_entropy_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, nb::handle lse,
         nb::handle grad_loss, int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size,
         const vpce::LossOptions& options, const vpce::HeadOptions& head_options, nb::handle grad_hidden,
         nb::handle grad_weight, nb::handle grad_bias, bool accumulate_hidden, bool accumulate_weight,
         bool accumulate_bias, nb::handle weights) {
        const Head operands(hidden, weight, bias);
        const auto targets_array = as_array<Array>(targets, "targets");
        const auto lse_array = as_array<Array>(lse, "lse");
        const auto grad_loss_array = as_array<Array>(grad_loss, "grad_loss");
        const auto weights_array = optional_array<Array>(weights, "weights");
        const vpce::TensorView y = view(targets_array, "targets");
        const vpce::TensorView e = view(lse_array, "lse");
        const vpce::TensorView g = view(grad_loss_array, "grad_loss");
        const auto w = optional_view(weights_array, "weights");
        const Gradients gradients(grad_hidden, grad_weight, grad_bias, accumulate_hidden, accumulate_weight,
                                  accumulate_bias);
        nb::gil_scoped_release release;
        check(vpce::linear_cross_entropy_backward(operands.inputs, y, e, g,
                                                  shard_of(vocab_begin, vocab_end, vocab_size), options, head_options,
                                                  gradients.views, w ? &*w : nullptr, operands.workspace()));
      },
      nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("targets").none(),
      nb::arg("lse").none(), nb::arg("grad_loss").none(), nb::arg("vocab_begin"), nb::arg("vocab_end"),
      nb::arg("vocab_size"), nb::arg("options"), nb::arg("head"), nb::arg("grad_hidden").none() = nb::none(),
      nb::arg("grad_weight").none() = nb::none(), nb::arg("grad_bias").none() = nb::none(),
      nb::arg("accumulate_hidden") = false, nb::arg("accumulate_weight") = false, nb::arg("accumulate_bias") = false,
      nb::arg("weights").none() = nb::none(),
      "Fused head backward: no collective; recomputes the logit tiles and writes (or, with accumulate_*, adds "
      "into float32) the gradients given; None for one not wanted. grad_hidden is this rank's part.");

  m.def(
      "linear_cross_entropy_forward_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, const vpce::HeadOptions& head_options,
         float grad_loss, nb::handle loss, nb::handle lse, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, bool accumulate_hidden, bool accumulate_weight, bool accumulate_bias, nb::handle weights,
         nb::handle target_is_argmax, nb::handle entropy, int rank, int size, nb::object all_gather) {
        require_all_gather(size, all_gather);
        const Head operands(hidden, weight, bias);
        const auto targets_array = as_array<Array>(targets, "targets");
        const auto loss_array = as_array<MutableArray>(loss, "loss");
        const auto lse_array = as_array<MutableArray>(lse, "lse");
        const vpce::TensorView y = view(targets_array, "targets");
        const vpce::TensorView l = view(loss_array, "loss");
        const vpce::TensorView e = view(lse_array, "lse");
        const Gradients gradients(grad_hidden, grad_weight, grad_bias, accumulate_hidden, accumulate_weight,
                                  accumulate_bias);
        const Extras extras(weights, target_is_argmax, entropy);
        CallbackCommunicator comm(rank, size, std::move(all_gather));
        vpce::Status status;
        int64_t collectives = 0;
        {
          nb::gil_scoped_release release;
          status = vpce::linear_cross_entropy_forward_backward(
              comm, operands.inputs, y, shard_of(vocab_begin, vocab_end, vocab_size), options, head_options,
              grad_loss, l, e, gradients.views, extras.views, operands.workspace(), &collectives);
        }
        comm.check_call(status);
        return collectives;
      },
      nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("targets").none(),
      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("head"),
      nb::arg("grad_loss"), nb::arg("loss").none(), nb::arg("lse").none(), nb::arg("grad_hidden").none() = nb::none(),
      nb::arg("grad_weight").none() = nb::none(), nb::arg("grad_bias").none() = nb::none(),
      nb::arg("accumulate_hidden") = false, nb::arg("accumulate_weight") = false, nb::arg("accumulate_bias") = false,
      nb::arg("weights").none() = nb::none(), nb::arg("target_is_argmax").none() = nb::none(),
      nb::arg("entropy").none() = nb::none(), nb::arg("rank") = 0, nb::arg("size") = 1,
      nb::arg("all_gather") = nb::none(),
      "Fused head, chunked mode (reduction sum or mean): the loss and, with the upstream gradient grad_loss known "
      "now, the gradients, chunk by chunk; one all_gather per chunk. Returns the number of all_gathers made.");

  m.def(
      "linear_cross_entropy_local_stats",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle targets, int64_t vocab_begin,
         int64_t vocab_end, int64_t vocab_size, const vpce::LossOptions& options, const vpce::HeadOptions& head_options,
         nb::handle stats) {
        const Head operands(hidden, weight, bias);
        const auto targets_array = as_array<Array>(targets, "targets");
        const auto stats_array = as_array<MutableArray>(stats, "stats");
        const vpce::TensorView y = view(targets_array, "targets");
        const vpce::TensorView s = view(stats_array, "stats");
        nb::gil_scoped_release release;
        check(vpce::linear_cross_entropy_local_stats(operands.inputs, y, shard_of(vocab_begin, vocab_end, vocab_size),
                                                     options, head_options, s));
      },
      nb::arg("hidden").none(), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("targets").none(),
      nb::arg("vocab_begin"), nb::arg("vocab_end"), nb::arg("vocab_size"), nb::arg("options"), nb::arg("head"),
      nb::arg("stats").none(),
      "Fused head, staged 1: this rank's [N, 4] (or [N, 6]) float32 statistics of its logits, without them.");

  m.def(
      "all_reduce_hidden_gradient",
      [](nb::handle grad_hidden, int rank, int size, nb::object all_gather) {
        require_all_gather(size, all_gather);
        const auto grad_array = as_array<MutableArray>(grad_hidden, "grad_hidden");
        const vpce::TensorView g = view(grad_array, "grad_hidden");
        CallbackCommunicator comm(rank, size, std::move(all_gather));
        vpce::Status status;
        {
          nb::gil_scoped_release release;
          status = vpce::all_reduce_hidden_gradient(comm, g);
        }
        comm.check_call(status);
      },
      nb::arg("grad_hidden").none(), nb::arg("rank") = 0, nb::arg("size") = 1, nb::arg("all_gather") = nb::none(),
      "grad_hidden (float32, this rank's part) <- the sum of every rank's part, in rank order (the same bits on "
      "every rank), through all_gather(send, recv) calls of at most 64 MiB per rank.");
}
