// bindings/python/src/head_operands.h: what the fused head's bindings share (the loss's,
// head_bindings.cc, and the RL outputs', rl_bindings.cc): the operands as HeadInputs, the
// gradients as HeadGradients, and their keyword lists.
#pragma once

#include <nanobind/nanobind.h>

#include <tuple>
#include <utility>

#include "arguments.h"

namespace vpce::python {

// The fused head's operands, as the HeadInputs that points into them (so the object must
// stay where it is while the call runs).
class Head {
 public:
  Head(nb::handle hidden, nb::handle weight, nb::handle bias)
      : hidden_(hidden, "hidden"), weight_(weight, "weight"), bias_(bias, "bias") {
    inputs.hidden = hidden_.view;
    inputs.weight = weight_.view;
    inputs.bias = bias_.get();
  }
  // The CPU head's buffers (tiles, a chunk of logits: tens of MiB), kept between the steps
  // on each calling thread, as PyTorch's caching allocator keeps its blocks: a step that
  // finds them large enough neither allocates nor faults in fresh pages. None on a device.
  vpce::Workspace* workspace() const {
    thread_local vpce::Workspace cpu_workspace;
    return inputs.hidden.device.type == vpce::DeviceType::kCPU ? &cpu_workspace : nullptr;
  }

 private:
  Input hidden_, weight_;
  OptionalInput bias_;

 public:
  vpce::HeadInputs inputs;
};

// The gradients a head backward writes or adds into (each optional), as the HeadGradients
// that points into them.
struct Gradients {
  Gradients(nb::handle hidden, nb::handle weight, nb::handle bias, bool accumulate_hidden, bool accumulate_weight,
            bool accumulate_bias)
      : h(hidden, "grad_hidden"), w(weight, "grad_weight"), b(bias, "grad_bias") {
    views.hidden = {h.get(), accumulate_hidden};
    views.weight = {w.get(), accumulate_weight};
    views.bias = {b.get(), accumulate_bias};
  }
  OptionalOutput h, w, b;
  vpce::HeadGradients views;
};

// The backward's gradients and whether each is added into: the same keywords in the
// recompute backward and the chunked mode.
inline auto gradient_args() {
  return std::make_tuple(nb::arg("grad_hidden").none() = nb::none(), nb::arg("grad_weight").none() = nb::none(),
                         nb::arg("grad_bias").none() = nb::none(), nb::arg("accumulate_hidden") = false,
                         nb::arg("accumulate_weight") = false, nb::arg("accumulate_bias") = false);
}

// m.def(name, function, the nb::arg lists of `groups` (tuples) in order, then doc).
template <class F, class... Groups>
void def_with_groups(nb::module_& m, const char* name, F&& function, const char* doc, const Groups&... groups) {
  std::apply([&](const auto&... args) { m.def(name, std::forward<F>(function), args..., doc); },
             std::tuple_cat(groups...));
}

}  // namespace vpce::python
