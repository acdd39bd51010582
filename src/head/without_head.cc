// head/without_head.cc: the fused head in a build without it (CMake's VPCE_WITH_HEAD=OFF,
// which needs no oneDNN): each of its GEMM-based functions returns kUnsupported, the same on
// every rank, before any collective. all_reduce_hidden_gradient (reduce_hidden.cc) stays.
#include "vpce/head.h"

namespace vpce {
namespace {

Status no_head(const char* function) {
  return {Code::kUnsupported, std::string(function) +
                                  ": this build of vpce has no fused head (built with "
                                  "VPCE_WITH_HEAD=OFF); compute the logits and call vpce/loss.h"};
}

}  // namespace

Status linear_cross_entropy_forward(Communicator&, const HeadInputs&, const TensorView&, const VocabShard&,
                                    const LossOptions&, const HeadOptions&, const TensorView&, const TensorView&,
                                    const ForwardExtras&, Workspace*) {
  return no_head("linear_cross_entropy_forward");
}

Status linear_cross_entropy_backward(const HeadInputs&, const TensorView&, const TensorView&, const TensorView&,
                                     const VocabShard&, const LossOptions&, const HeadOptions&, const HeadGradients&,
                                     const TensorView*, Workspace*) {
  return no_head("linear_cross_entropy_backward");
}

Status linear_cross_entropy_forward_backward(Communicator&, const HeadInputs&, const TensorView&, const VocabShard&,
                                             const LossOptions&, const HeadOptions&, float, const TensorView&,
                                             const TensorView&, const HeadGradients&, const ForwardExtras&, Workspace*,
                                             int64_t* collectives) {
  if (collectives != nullptr) *collectives = 0;
  return no_head("linear_cross_entropy_forward_backward");
}

Status linear_cross_entropy_local_stats(const HeadInputs&, const TensorView&, const VocabShard&, const LossOptions&,
                                        const HeadOptions&, const TensorView&) {
  return no_head("linear_cross_entropy_local_stats");
}

}  // namespace vpce
