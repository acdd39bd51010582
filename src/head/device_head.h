// head/device_head.h: the fused head on device tensors (CUDA: cuBLAS GEMMs per tile and
// vpce's CUDA kernels as the epilogue), behind the same public functions as the CPU path.
//
// src/head/head.cc sends a call here when inputs.hidden is a CUDA tensor; each function
// has its public counterpart's contract (vpce/head.h) and validates its own arguments.
// Defined in src/head/cuda/ for CUDA builds, and in device_head_cpu_only.cc otherwise
// (which refuses with kUnsupported naming hidden.device).
#pragma once

#include "vpce/head.h"

namespace vpce::detail {

Status device_linear_cross_entropy_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                           const VocabShard& shard, const LossOptions& options, const HeadOptions& head,
                                           const TensorView& loss, const TensorView& lse, const ForwardExtras& extras,
                                           Workspace* workspace);

Status device_linear_cross_entropy_backward(const HeadInputs& inputs, const TensorView& targets, const TensorView& lse,
                                            const TensorView& grad_loss, const VocabShard& shard,
                                            const LossOptions& options, const HeadOptions& head,
                                            const HeadGradients& gradients, const TensorView* weights,
                                            Workspace* workspace);

Status device_linear_cross_entropy_forward_backward(Communicator& comm, const HeadInputs& inputs,
                                                    const TensorView& targets, const VocabShard& shard,
                                                    const LossOptions& options, const HeadOptions& head,
                                                    float grad_loss, const TensorView& loss, const TensorView& lse,
                                                    const HeadGradients& gradients, const ForwardExtras& extras,
                                                    Workspace* workspace, int64_t* collectives);

Status device_linear_cross_entropy_local_stats(const HeadInputs& inputs, const TensorView& targets,
                                               const VocabShard& shard, const LossOptions& options,
                                               const HeadOptions& head, const TensorView& stats);

}  // namespace vpce::detail
