// exchange.h: the forward's one all-gather on the CPU, shared by forward() (loss/forward.cc) and
// the fused head (head/): this rank's header and [N, W] statistics out, every rank's in,
// the group's agreement checked, the statistics merged in rank order.
#pragma once

#include <cstdint>
#include <functional>

#include "protocol.h"
#include "validate.h"
#include "vpce/communicator.h"
#include "vpce/options.h"
#include "workspace.h"

namespace vpce::detail {

// What this rank announces in its header.
struct ExchangeCall {
  int64_t tokens = 0;  // N; when the rank's arguments are bad, a count the others can match
  int64_t width = kStatsWidth;
  VocabShard shard;
  DataType dtype{};
  OperationBlock operation;  // which operation gathers, and what else its ranks must agree on
  LossOptions options;
  bool has_weights = false;
  uint64_t inputs_hash = 0;
};

// comm's rank and size make sense: 0 <= rank() < size() (kInvalidArgument naming `comm`).
Status check_comm(const Communicator& comm);

// The number of tokens a rank announces even when its own arguments are bad, so that the
// payload sizes still agree and the other ranks learn its error: the targets' element
// count when the targets view itself is valid and the count is plausible, else 0.
int64_t announced_tokens(const TensorView& targets);

// Collective over comm: exactly one all_gather. `local` is this rank's own argument check;
// when it is fine, fill(stats) writes this rank's [N, W] float32 stats into the payload (a
// fill that fails, for want of memory, makes its error this rank's).
// A rank whose arguments are bad (or whose buffers cannot be allocated) still joins, with
// its error in the header, so that every rank returns the same error. On success *merged
// views the [N, W] merged statistics, in buffers.merged.
Status exchange_stats(Communicator& comm, Workspace::Buffers& buffers, const ExchangeCall& call, Status local,
                      const std::function<Status(const RowMatrix& stats)>& fill, RowMatrix* merged);

}  // namespace vpce::detail
