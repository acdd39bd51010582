// rl/without_head.cc: the RL outputs' fused-head entries in a build without the head
// (VPCE_WITH_HEAD=OFF): kUnsupported, the same on every rank, before any collective.
#include <string>

#include "vpce/rl.h"

namespace vpce::rl {
namespace {

Status no_head(const char* function) {
  return {Code::kUnsupported, std::string(function) +
                                  ": this build of vpce has no fused head (built with VPCE_WITH_HEAD=OFF); compute "
                                  "the logits and call vpce::rl::forward"};
}

}  // namespace

Status linear_forward(Communicator&, const HeadInputs&, const TensorView&, const VocabShard&, const Options&,
                      const HeadOptions&, const Outputs&, const TensorView*, Workspace*) {
  return no_head("rl::linear_forward");
}

Status linear_backward(const HeadInputs&, const TensorView&, const TensorView&, const TensorView*, const Upstream&,
                       const VocabShard&, const Options&, const HeadOptions&, const HeadGradients&, const TensorView*,
                       Workspace*) {
  return no_head("rl::linear_backward");
}

Status linear_forward_backward(Communicator&, const HeadInputs&, const TensorView&, const VocabShard&, const Options&,
                               const HeadOptions&, const Upstream&, const Outputs&, const HeadGradients&,
                               const TensorView*, Workspace*, int64_t* collectives) {
  if (collectives != nullptr) *collectives = 0;
  return no_head("rl::linear_forward_backward");
}

}  // namespace vpce::rl
