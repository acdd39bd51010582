// head/device_head.h: the fused head on device tensors (CUDA: cuBLAS GEMMs per tile and
// vpce's CUDA kernels as the epilogue), behind the same public functions as the CPU path.
//
// src/head/head.cc sends a call here when inputs.hidden is a CUDA tensor; each function
// has its public counterpart's contract (vpce/head.h) and validates its own arguments.
// Defined in src/head/cuda/ for CUDA builds, and in device_head_cpu_only.cc otherwise
// (which refuses with kUnsupported naming hidden.device).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "../cuda/dispatch.h"
#include "../protocol.h"
#include "head_args.h"
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

// ---- the RL outputs (src/rl/head.cc), recompute mode ---------------------------------------

// What the RL outputs' forward puts in the loss's place: its gather's operation block and
// the message its header carries for a bad value the device finds, its outputs (device
// vectors), its parameters (with the temperatures, device memory).
struct PolicyForward {
  OperationBlock operation;
  std::string found_message;
  PolicyForwardOutputs out;
  LossParams params;
  // The chunked mode: the upstream gradients (device vectors; wanted) and the regions of the
  // RL outputs' tensors, which the gradients must not overlap.
  PolicyBackwardInputs upstream;
  std::vector<NamedRegion> regions;
};
// Given this rank's check of the head's operands (`local`, and `a` when it passed), the RL
// outputs' own checks and their forward: returns the rank's check.
using PreparePolicy = std::function<Status(Status local, const HeadArgs& a, PolicyForward* out)>;

// rl::linear_forward on device tensors: the head's forward with the RL outputs' last stage
// (cuda::merge_and_policy); every rank joins the one gather.
Status device_policy_linear_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                    const VocabShard& shard, const LossOptions& options, const HeadOptions& head,
                                    const PreparePolicy& prepare, Workspace* workspace);

// rl::linear_forward_backward (the chunked mode) on device tensors: the loss's chunked forward
// with the RL outputs' last stage per chunk and their gradient, one gather per chunk.
// `prepare` also fills the upstream gradients and the regions.
Status device_policy_linear_forward_backward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                             const VocabShard& shard, const LossOptions& options,
                                             const HeadOptions& head, const HeadGradients& gradients,
                                             const PreparePolicy& prepare, Workspace* workspace, int64_t* collectives);

// rl::linear_backward on device tensors: `check` the RL outputs' own checks of the validated
// operands, which fill lse, the upstream gradients and E_p[z] (device vectors) and the
// parameters (with the temperatures).
using CheckPolicyBackward = std::function<Status(const HeadArgs& a, TokenVector* lse, PolicyBackwardInputs* policy,
                                                 LossParams* params, std::vector<NamedRegion>* regions)>;
Status device_policy_linear_backward(const HeadInputs& inputs, const TensorView& targets, const VocabShard& shard,
                                     const LossOptions& options, const HeadOptions& head,
                                     const HeadGradients& gradients, const CheckPolicyBackward& check,
                                     Workspace* workspace);

Status device_linear_cross_entropy_local_stats(const HeadInputs& inputs, const TensorView& targets,
                                               const VocabShard& shard, const LossOptions& options,
                                               const HeadOptions& head, const TensorView& stats);

}  // namespace vpce::detail
