// exchange.cc: the forward's one all-gather (see exchange.h).
#include "exchange.h"

#include <cstring>
#include <exception>
#include <string>

#include "cpu/kernels.h"
#include "protocol.h"

namespace vpce::detail {
namespace {

// A count whose payload buffer stays proportional to what the caller holds.
constexpr int64_t kMaxAnnouncedTokens = int64_t{1} << 26;

}  // namespace

Status check_comm(const Communicator& comm) {
  if (comm.size() >= 1 && comm.rank() >= 0 && comm.rank() < comm.size()) return {};
  return {Code::kInvalidArgument,
          expected_got("comm", "0 <= rank() < size()",
                       "rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()))};
}

int64_t announced_tokens(const TensorView& targets) {
  if (targets.ndim < 0 || targets.ndim > TensorView::kMaxDims) return 0;
  int64_t n = 1;
  for (int d = 0; d < targets.ndim; ++d) {
    if (targets.shape[d] < 0 || __builtin_mul_overflow(n, targets.shape[d], &n)) return 0;
  }
  TokenVector valid;
  if (!as_token_vector(targets, "targets", n, &valid).ok()) return 0;
  if (targets.dtype != kInt32 && targets.dtype != kInt64) return 0;
  return n <= kMaxAnnouncedTokens ? n : 0;
}

Status exchange_stats(Communicator& comm, Workspace::Buffers& buffers, const ExchangeCall& call, Status local,
                      const std::function<Status(const RowMatrix& stats)>& fill, RowMatrix* merged) {
  const int rank = comm.rank();
  const int ranks = comm.size();
  int64_t n = call.tokens;
  const int64_t width = call.width;
  std::size_t payload = payload_bytes(n, width);
  try {
    buffers.send.resize(payload);
    buffers.recv.resize(payload * static_cast<std::size_t>(ranks));
    buffers.merged.resize(static_cast<std::size_t>(n * width) * sizeof(float));
    buffers.rank_columns.resize(static_cast<std::size_t>(ranks));
  } catch (const std::exception&) {
    // Still join the collective, with the header alone, so that no rank waits for this one.
    if (local.ok()) {
      local = {Code::kSystemError, "forward: could not allocate " +
                                       std::to_string(payload * static_cast<std::size_t>(ranks + 1)) +
                                       " bytes of workspace"};
    }
    n = 0;
    payload = payload_bytes(0, width);
    try {
      buffers.send.resize(payload);
      buffers.recv.resize(payload * static_cast<std::size_t>(ranks));
    } catch (const std::exception&) {
      return local;  // not even the headers fit: the other ranks will time out
    }
  }

  if (local.ok()) {
    local =
        fill(RowMatrix{reinterpret_cast<char*>(buffers.send.data() + sizeof(RankHeader)), kFloat32, n, width, width});
  }
  const RankHeader header = make_header(rank, ranks, n, width, call.shard, call.dtype, call.options, call.has_weights,
                                        call.inputs_hash, call.operation, local);
  std::memcpy(buffers.send.data(), &header, sizeof(header));

  Status gathered = comm.all_gather(buffers.send.data(), buffers.recv.data(), payload);
  if (!gathered.ok()) return local.ok() ? gathered : local;
  if (ranks == 1 && !local.ok()) return local;  // alone: its own error, whole and without "rank 0 of 1"
  const auto* recv = reinterpret_cast<const char*>(buffers.recv.data());
  if (Status group = check_group(recv, payload, ranks, rank); !group.ok()) return group;

  *merged = RowMatrix{reinterpret_cast<char*>(buffers.merged.data()), kFloat32, n, width, width};
  // With label smoothing each rank's sum of logits is relative to its max: the merge rebases
  // it by the rank's valid columns, from the headers (checked above to partition [0, V));
  // with Megatron's legacy smoothing only this rank's own shard counts.
  const LossParams params = loss_params(call.options, call.shard);
  const int64_t* columns = nullptr;
  if (params.with_sum_logits() && buffers.rank_columns.size() == static_cast<std::size_t>(ranks)) {
    for (int r = 0; r < ranks; ++r) {
      RankHeader h;
      std::memcpy(&h, recv + static_cast<std::size_t>(r) * payload, sizeof(h));
      buffers.rank_columns[static_cast<std::size_t>(r)] = merged_mean_columns(h.vocab_begin, h.vocab_end, params);
    }
    columns = buffers.rank_columns.data();
  }
  merge_stats_kernel(reinterpret_cast<const float*>(recv + sizeof(header)),
                     static_cast<int64_t>(payload / sizeof(float)), ranks, width, columns, call.options.num_threads,
                     *merged);
  return {};
}

}  // namespace vpce::detail
