// comm/gather_size_hint.h: what the backends add when ranks pass all_gather different sizes:
// what sets the size of vpce's own gathers, so that the message says where to look.
#pragma once

namespace vpce::detail {

inline constexpr const char* kGatherSizeHint =
    " (a vpce call gathers a size set by its number of tokens (in the fused head's chunked mode, by its chunk: "
    "head.chunk_tokens and head.token_block), the outputs it was asked for (the extras, sum_p_squared) and its "
    "operation: do the ranks agree on them?)";

}  // namespace vpce::detail
