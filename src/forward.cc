// forward.cc: the one-call forward: local stats, one all-gather, agreement check, merge,
// loss. Outputs are written only after every rank's arguments have been checked.
#include <cstring>
#include <new>
#include <vector>

#include "cpu/kernels.h"
#include "protocol.h"
#include "validate.h"
#include "vpce/loss.h"

namespace vpce {

struct Workspace::Buffers {
  std::vector<std::byte> send;    // this rank's payload: header + [N, 4] stats
  std::vector<std::byte> recv;    // every rank's payload, rank order
  std::vector<std::byte> merged;  // [N, 4] merged stats
};

Workspace::Workspace() : buffers_(std::make_unique<Buffers>()) {}
Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;

std::size_t Workspace::capacity() const {
  if (!buffers_) return 0;
  return buffers_->send.capacity() + buffers_->recv.capacity() + buffers_->merged.capacity();
}

struct WorkspaceAccess {
  static Workspace::Buffers* buffers(Workspace& w) { return w.buffers_.get(); }
};

namespace {

using detail::LossInputs;
using detail::RowMatrix;
using detail::TokenVector;

// The number of tokens a rank announces even when its own arguments are bad, so that the
// payload sizes still agree and the other ranks learn its error: the targets' element
// count when their shape is readable, else 0.
int64_t announced_tokens(const TensorView& targets) {
  if (targets.ndim < 0 || targets.ndim > TensorView::kMaxDims) return 0;
  int64_t n = 1;
  for (int d = 0; d < targets.ndim; ++d) {
    if (targets.shape[d] < 0 || __builtin_mul_overflow(n, targets.shape[d], &n)) return 0;
  }
  return n <= (int64_t{1} << 36) ? n : 0;
}

Status check_outputs(const LossInputs& in, const TensorView& loss, const TensorView& lse,
                     TokenVector* loss_out, TokenVector* lse_out) {
  const int64_t n = in.logits.rows;
  if (Status s = detail::as_float_tokens(loss, "loss", n, loss_out); !s.ok()) return s;
  if (Status s = detail::as_float_tokens(lse, "lse", n, lse_out); !s.ok()) return s;
  const struct {
    const char* name;
    const char* begin;
    const char* end;
  } regions[] = {{"loss", loss_out->base, loss_out->end_byte()},
                 {"lse", lse_out->base, lse_out->end_byte()},
                 {"the logits", in.logits.begin_byte(), in.logits.end_byte()},
                 {"the targets", in.targets.base, in.targets.end_byte()}};
  for (int out = 0; out < 2; ++out) {
    for (int other = out + 1; other < 4; ++other) {
      if (detail::overlaps(regions[out].begin, regions[out].end, regions[other].begin,
                           regions[other].end)) {
        return {Code::kInvalidArgument,
                detail::expected_got(regions[out].name,
                                     std::string("memory that does not overlap ") +
                                         regions[other].name,
                                     "an overlapping buffer")};
      }
    }
  }
  return {};
}

}  // namespace

Status forward(Communicator& comm, const TensorView& logits, const TensorView& targets,
               const VocabShard& shard, const LossOptions& options, const TensorView& loss,
               const TensorView& lse, Workspace* workspace) {
  const int rank = comm.rank();
  const int ranks = comm.size();
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    return {Code::kInvalidArgument,
            detail::expected_got("comm", "0 <= rank() < size()",
                                 "rank " + std::to_string(rank) + " of " + std::to_string(ranks))};
  }

  LossInputs in;
  TokenVector loss_out;
  TokenVector lse_out;
  Status local = detail::check_loss_inputs(logits, targets, shard, options, &in);
  if (local.ok()) local = check_outputs(in, loss, lse, &loss_out, &lse_out);
  const int64_t n = local.ok() ? in.logits.rows : announced_tokens(targets);

  Workspace own;
  Workspace::Buffers* buffers = WorkspaceAccess::buffers(workspace != nullptr ? *workspace : own);
  const std::size_t payload = detail::payload_bytes(n);
  try {
    buffers->send.resize(payload);
    buffers->recv.resize(payload * static_cast<std::size_t>(ranks));
    buffers->merged.resize(static_cast<std::size_t>(n) * sizeof(TokenStats));
  } catch (const std::bad_alloc&) {
    return {Code::kSystemError, "forward: could not allocate " +
                                    std::to_string(payload * static_cast<std::size_t>(ranks + 1)) +
                                    " bytes of workspace"};
  }

  const detail::RankHeader header =
      detail::make_header(rank, ranks, n, shard, logits.dtype, options, in.targets_hash, local);
  std::memcpy(buffers->send.data(), &header, sizeof(header));
  if (local.ok()) {
    const RowMatrix stats{reinterpret_cast<char*>(buffers->send.data() + sizeof(header)), kFloat32,
                          n, 4, 4};
    detail::local_stats_kernel(in.logits, in.targets, shard.vocab_begin,
                               options.label_smoothing != 0.0f, options.num_threads, stats);
  }

  Status gathered = comm.all_gather(buffers->send.data(), buffers->recv.data(), payload);
  if (!gathered.ok()) return local.ok() ? gathered : local;
  const auto* recv = reinterpret_cast<const char*>(buffers->recv.data());
  if (Status group = detail::check_group(recv, payload, ranks, rank); !group.ok()) return group;

  const RowMatrix merged{reinterpret_cast<char*>(buffers->merged.data()), kFloat32, n, 4, 4};
  detail::merge_stats_kernel(reinterpret_cast<const float*>(recv + sizeof(header)),
                             static_cast<int64_t>(payload / sizeof(float)), ranks, n, 4,
                             options.num_threads, merged);
  detail::loss_kernel(merged, shard.vocab_size,
                      detail::smoothing_terms(options.label_smoothing, shard.vocab_size),
                      options.num_threads, loss_out, lse_out);
  return {};
}

}  // namespace vpce
