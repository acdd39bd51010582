// head/device_head_cpu_only.cc: the fused head's device path in builds without CUDA: every
// call refuses with kUnsupported naming hidden.device.
#include "device_head.h"

#include "../validate.h"

namespace vpce::detail {
namespace {

Status refuse(const TensorView& hidden) {
  if (Status s = device_supported(hidden.device, "hidden"); !s.ok()) return s;
  return {Code::kUnsupported,
          expected_got("hidden.device", "cpu (this build has no fused head on the device)", to_string(hidden.device))};
}

}  // namespace

Status device_linear_cross_entropy_forward(Communicator&, const HeadInputs& inputs, const TensorView&,
                                           const VocabShard&, const LossOptions&, const HeadOptions&, const TensorView&,
                                           const TensorView&, const ForwardExtras&, Workspace*) {
  return refuse(inputs.hidden);
}

Status device_linear_cross_entropy_backward(const HeadInputs& inputs, const TensorView&, const TensorView&,
                                            const TensorView&, const VocabShard&, const LossOptions&,
                                            const HeadOptions&, const HeadGradients&, const TensorView*, Workspace*) {
  return refuse(inputs.hidden);
}

Status device_linear_cross_entropy_forward_backward(Communicator&, const HeadInputs& inputs, const TensorView&,
                                                    const VocabShard&, const LossOptions&, const HeadOptions&, float,
                                                    const TensorView&, const TensorView&, const HeadGradients&,
                                                    const ForwardExtras&, Workspace*, int64_t*) {
  return refuse(inputs.hidden);
}

Status device_linear_cross_entropy_local_stats(const HeadInputs& inputs, const TensorView&, const VocabShard&,
                                               const LossOptions&, const HeadOptions&, const TensorView&) {
  return refuse(inputs.hidden);
}

Status device_policy_linear_forward(Communicator&, const HeadInputs& inputs, const TensorView&, const VocabShard&,
                                    const LossOptions&, const HeadOptions&, const PreparePolicy&, Workspace*) {
  return refuse(inputs.hidden);
}

Status device_policy_linear_forward_backward(Communicator&, const HeadInputs& inputs, const TensorView&,
                                             const VocabShard&, const LossOptions&, const HeadOptions&,
                                             const HeadGradients&, const PreparePolicy&, Workspace*,
                                             int64_t* collectives) {
  if (collectives != nullptr) *collectives = 0;
  return refuse(inputs.hidden);
}

Status device_policy_linear_backward(const HeadInputs& inputs, const TensorView&, const VocabShard&, const LossOptions&,
                                     const HeadOptions&, const HeadGradients&, const CheckPolicyBackward&, Workspace*) {
  return refuse(inputs.hidden);
}

}  // namespace vpce::detail
