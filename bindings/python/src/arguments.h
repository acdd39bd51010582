// bindings/python/src/arguments.h: what every binding of vpce._vpce shares: Python arguments
// as vpce::TensorView (no copy) with TypeError naming the argument, vpce errors raised as
// vpce.Error, option classes' checked fields, the forward's optional per-token tensors, and
// the forward's collective through a Python callable.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>  // def_fields' setters take None too
#include <nanobind/stl/string.h>

#include <cstdint>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "vpce/vpce.h"

namespace vpce::python {

namespace nb = nanobind;

using Array = nb::ndarray<nb::ro>;   // any dtype, device, layout; read through
using MutableArray = nb::ndarray<>;  // written through

// vpce.Error: a vpce Status that is not ok.
struct StatusError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Raises vpce.Error for a failed status: a group's error ("rank r of R: <code>: ...", the
// same on every rank) as that text alone, any other as "<code>: <message>".
void check(const vpce::Status& status);

// `value` as an array (no copy), or TypeError naming the argument, what was expected and what
// it is (its type, dtype, device, layout, and why nanobind refused it).
template <class A>
A as_array(nb::handle value, const char* name);

// An array's TensorView, or vpce.Error when it has more dimensions than a TensorView holds.
vpce::TensorView view_of(const nb::ndarray<nb::ro>& a, const char* name);
vpce::TensorView view_of(const nb::ndarray<>& a, const char* name);

// An argument as a TensorView over the array it came as, which it keeps alive for the call:
// Tensor<Array> for an input, Tensor<MutableArray> for an output.
template <class A>
struct Tensor {
  Tensor(nb::handle value, const char* name) : array(as_array<A>(value, name)), view(view_of(array, name)) {}
  operator const vpce::TensorView&() const { return view; }  // NOLINT: passed where a view is
  A array;
  vpce::TensorView view;
};
using Input = Tensor<Array>;
using Output = Tensor<MutableArray>;

// The same for an argument that may be None: get() is then null.
template <class A>
struct OptionalTensor {
  OptionalTensor(nb::handle value, const char* name) {
    if (value.is_none()) return;
    array = as_array<A>(value, name);
    view = view_of(*array, name);
  }
  OptionalTensor(const OptionalTensor&) = delete;  // get() points into it
  OptionalTensor& operator=(const OptionalTensor&) = delete;
  const vpce::TensorView* get() const { return view ? &*view : nullptr; }
  std::optional<A> array;
  std::optional<vpce::TensorView> view;
};
using OptionalInput = OptionalTensor<Array>;
using OptionalOutput = OptionalTensor<MutableArray>;

// A Python type as "module.qualname", a value's type so, and a value's repr cut to 80 characters.
std::string qualified_name(nb::handle type);
std::string value_type_name(nb::handle value);
std::string short_repr(nb::handle value);

// A bool, or something holding one (a 0-d bool tensor or NumPy bool), which Python would
// let pass as the number 1 or 0: never a count, a class id or a weight here.
bool is_boolean(nb::handle value);

// A LossOptions (or HeadOptions) field's value from Python, converted as int() / float()
// would (an enum must be its vpce type), with TypeError or ValueError naming the field
// instead of nanobind's signature dump.
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

// The optional per-token tensors of a forward, as the ForwardExtras that points into them
// (so the object must stay where it is while the call runs).
struct Extras {
  Extras(nb::handle weights, nb::handle target_is_argmax, nb::handle entropy)
      : w(weights, "weights"), a(target_is_argmax, "target_is_argmax"), h(entropy, "entropy") {
    views.weights = w.get();
    views.target_is_argmax = a.get();
    views.entropy = h.get();
  }
  OptionalInput w;
  OptionalOutput a, h;
  vpce::ForwardExtras views;
};

class CallbackCommunicator final : public vpce::Communicator {
 public:
  CallbackCommunicator(int rank, int size, nb::object all_gather)
      : rank_(rank), size_(size), all_gather_(std::move(all_gather)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "python"; }

  // The gather through the callable, with the GIL, on Python-owned copies of the buffers.
  vpce::Status all_gather(const void* send, void* recv, std::size_t bytes) override;

  // After the call (with the GIL): re-raises what the callable raised, as it was (its class,
  // KeyboardInterrupt and a framework's timeout too), rather than as a vpce.Error that
  // carries its traceback as text; else raises for a failed `status`.
  void check_call(const vpce::Status& status);

 private:
  int rank_;
  int size_;
  nb::object all_gather_;
  std::optional<nb::python_error> raised_;
};

// The fused head's operands, as views that HeadInputs points into (so the object must stay

// Runs kernel() (a vpce::Status) with the GIL released, then raises vpce.Error if it failed.
template <class F>
void released(F&& kernel) {
  vpce::Status status;
  {
    nb::gil_scoped_release release;
    status = kernel();
  }
  check(status);
}

// Runs kernel(comm) (a vpce::Status) with the GIL released, comm gathering through the Python
// callable all_gather (or copying, for one rank), then raises what the callable raised, or
// vpce.Error if the kernel failed.
template <class F>
void collective(int rank, int size, nb::object all_gather, F&& kernel) {
  CallbackCommunicator comm(rank, size, std::move(all_gather));
  vpce::Status status;
  {
    nb::gil_scoped_release release;
    status = kernel(comm);
  }
  comm.check_call(status);
}

// vpce.Error unless a group of `size` ranks has a callable to gather with.
void require_all_gather(int size, const nb::object& all_gather);

inline vpce::VocabShard shard_of(int64_t vocab_begin, int64_t vocab_end, int64_t vocab_size) {
  return {vocab_begin, vocab_end, vocab_size};
}

// The bindings of each operation, called by the module (module.cc).
void bind_loss(nb::module_& m);
void bind_head(nb::module_& m);
void bind_rows(nb::module_& m);
void bind_rl(nb::module_& m);

}  // namespace vpce::python
