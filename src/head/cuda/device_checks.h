// head/cuda/device_checks.h: the fused head's argument checks on CUDA tensors: the CPU's
// (head_args.h, which read no device values), the device of every tensor and that each is
// its memory, and cuBLAS's 32-bit sizes and strides.
#pragma once

#include <vector>

#include "../../validate.h"
#include "../head_args.h"
#include "vpce/head.h"

namespace vpce::detail::head_cuda {

Status check_same_device(const TensorView* t, const char* name, Device expected);

// cuBLAS takes 32-bit sizes and strides.
Status check_cublas_sizes(const HeadArgs& a);

// Every input of a device call: the CPU's checks (check_head_inputs, which reads no values
// of device tensors), the device of each tensor, that each is memory of it, cuBLAS's limits.
Status check_inputs(const HeadInputs& inputs, const TensorView& targets, const TensorView* weights,
                    const VocabShard& shard, const LossOptions& options, const HeadOptions& head, HeadArgs* out);

// A device output tensor: on hidden's device and memory of it.
Status check_output_device(const TensorView* t, const char* name, Device d);

// The gradients asked for (check_head_gradients' rules, on hidden's device), with strides
// that cuBLAS takes.
Status check_gradients(const HeadGradients& gradients, const HeadArgs& a, Device d,
                       const std::vector<NamedRegion>& inputs, HeadGradientArgs* out);

// The forward's outputs (float32, one per token; the loss one element for a reduction), on
// the device, overlapping neither each other nor the inputs.
Status check_forward_outputs(const HeadArgs& a, Device d, const LossOptions& options, const TensorView& loss,
                             const TensorView& lse, const ForwardExtras& extras, LossOutputs* out);

}  // namespace vpce::detail::head_cuda
