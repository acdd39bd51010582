// head/cuda/device_checks.cc: the fused head's checks on CUDA tensors (device_checks.h).
#include "device_checks.h"

#include <climits>
#include <string>
#include <utility>

#include "device_buffers.h"

namespace vpce::detail::head_cuda {

Status check_same_device(const TensorView* t, const char* name, Device expected) {
  if (t == nullptr) return {};
  if (t->device.type == expected.type && t->device.id == expected.id) return {};
  return {Code::kInvalidArgument, expected_got((std::string(name) + ".device").c_str(),
                                               device_text(expected) + " (hidden's device)", device_text(t->device))};
}

// cuBLAS takes 32-bit sizes and strides.
Status check_cublas_sizes(const HeadArgs& a) {
  const std::pair<int64_t, const char*> sizes[] = {{a.tokens(), "hidden: the number of tokens"},
                                                   {a.hidden_size(), "hidden.shape[-1]"},
                                                   {a.vocab_rows(), "weight.shape[0]"},
                                                   {a.hidden.row_stride, "hidden's row stride"},
                                                   {a.weight.row_stride, "weight's row stride"}};
  for (const auto& [value, name] : sizes) {
    if (value > INT32_MAX) {
      return {Code::kUnsupported, expected_got(name, "at most 2^31 - 1 (cuBLAS's sizes)", std::to_string(value))};
    }
  }
  return {};
}

// Every input of a device call: the CPU's checks (check_head_inputs, which reads no values
// of device tensors), the device of each tensor, that each is memory of it, cuBLAS's limits.
Status check_inputs(const HeadInputs& inputs, const TensorView& targets, const TensorView* weights,
                    const VocabShard& shard, const LossOptions& options, const HeadOptions& head, HeadArgs* out) {
  if (inputs.hidden.device.type != DeviceType::kCUDA) {
    return {Code::kInvalidArgument, expected_got("hidden.device", "cuda", device_text(inputs.hidden.device))};
  }
  if (Status s = check_head_inputs(inputs, targets, weights, shard, options, head, out); !s.ok()) return s;
  const Device d = inputs.hidden.device;
  if (Status s = check_same_device(&inputs.weight, "weight", d); !s.ok()) return s;
  if (Status s = check_same_device(inputs.bias, "bias", d); !s.ok()) return s;
  if (Status s = check_same_device(&targets, "targets", d); !s.ok()) return s;
  if (Status s = check_same_device(weights, "weights", d); !s.ok()) return s;
  if (Status s = check_cublas_sizes(*out); !s.ok()) return s;
  const std::pair<const TensorView*, const char*> views[] = {{&inputs.hidden, "hidden"},
                                                             {&inputs.weight, "weight"},
                                                             {inputs.bias, "bias"},
                                                             {&targets, "targets"},
                                                             {weights, "weights"}};
  for (const auto& [view, name] : views) {
    if (view == nullptr) continue;
    if (Status s = check_device_pointer(*view, name); !s.ok()) return s;
  }
  return {};
}

// A device output tensor: on hidden's device and memory of it.
Status check_output_device(const TensorView* t, const char* name, Device d) {
  if (t == nullptr) return {};
  if (Status s = check_same_device(t, name, d); !s.ok()) return s;
  return check_device_pointer(*t, name);
}

// The gradients asked for (check_head_gradients' rules, on hidden's device), with strides
// that cuBLAS takes.
Status check_gradients(const HeadGradients& gradients, const HeadArgs& a, Device d,
                       const std::vector<NamedRegion>& inputs, HeadGradientArgs* out) {
  HeadGradientArgs g;
  const auto on_device = [d](const TensorView& t, const char* name) { return check_output_device(&t, name, d); };
  if (Status s = check_head_gradients(gradients, a, inputs, on_device, &g); !s.ok()) return s;
  for (const GradientArgs* m : {&g.hidden, &g.weight}) {
    if (m->present() && m->matrix.row_stride > INT32_MAX) {
      return {Code::kUnsupported, expected_got("a gradient's row stride", "at most 2^31 - 1 (cuBLAS's strides)",
                                               std::to_string(m->matrix.row_stride))};
    }
  }
  *out = g;
  return {};
}

// The forward's outputs (float32, one per token; the loss one element for a reduction), on
// the device, overlapping neither each other nor the inputs.
Status check_forward_outputs(const HeadArgs& a, Device d, const LossOptions& options, const TensorView& loss,
                             const TensorView& lse, const ForwardExtras& extras, LossOutputs* out) {
  const std::pair<const TensorView*, const char*> views[] = {
      {&loss, "loss"}, {&lse, "lse"}, {extras.target_is_argmax, "target_is_argmax"}, {extras.entropy, "entropy"}};
  for (const auto& [view, name] : views) {
    if (Status s = check_output_device(view, name, d); !s.ok()) return s;
  }
  return detail::check_forward_outputs(a.tokens(), d, options, loss, lse, extras, input_regions(a), out);
}

}  // namespace vpce::detail::head_cuda
