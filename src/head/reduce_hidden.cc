// head/reduce_hidden.cc: all_reduce_hidden_gradient (vpce/head.h): the group's sum of the
// ranks' parts of grad_hidden through Communicator::all_gather, added in rank order so that
// every rank gets the same bits. One gather of a small header (shape and status, so the
// ranks agree on the number of pieces before any is sent), then one per piece of rows.
#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "../cpu/parallel.h"
#include "../exchange.h"
#include "../validate.h"
#include "vpce/head.h"

namespace vpce {
namespace {

constexpr uint32_t kMagic = 0x52485056;  // "VPHR"
constexpr int64_t kPieceBytes = int64_t{64} << 20;

struct ReduceHeader {
  uint32_t magic = kMagic;
  int32_t status = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t reserved = 0;
  char message[224] = {};  // this rank's error, truncated, NUL-terminated
};
static_assert(sizeof(ReduceHeader) == 256);

}  // namespace

Status all_reduce_hidden_gradient(Communicator& comm, const TensorView& grad_hidden) {
  if (Status s = detail::check_comm(comm); !s.ok()) return s;
  const int ranks = comm.size(), rank = comm.rank();
  detail::RowMatrix g;
  Status local = detail::check_device(grad_hidden, "grad_hidden", Device{});
  if (local.ok()) local = detail::check_dtype("grad_hidden", grad_hidden.dtype, {kFloat32}, "float32");
  if (local.ok()) local = detail::as_row_matrix(grad_hidden, "grad_hidden", &g);
  std::vector<float> send, recv;
  const int64_t piece_rows = local.ok() && g.cols > 0 ? std::max<int64_t>(1, kPieceBytes / 4 / g.cols) : 1;
  if (local.ok()) {
    try {
      const auto piece = static_cast<std::size_t>(std::min(piece_rows, g.rows) * g.cols);
      send.resize(piece);
      recv.resize(piece * static_cast<std::size_t>(ranks));
    } catch (const std::exception&) {
      local = {Code::kSystemError, "all_reduce_hidden_gradient: could not allocate its buffers"};
    }
  }
  ReduceHeader mine;
  mine.status = static_cast<int32_t>(local.code());
  mine.rows = local.ok() ? g.rows : 0;
  mine.cols = local.ok() ? g.cols : 0;
  std::memcpy(mine.message, local.message().data(), std::min(local.message().size(), sizeof(mine.message) - 1));
  std::vector<ReduceHeader> headers(static_cast<std::size_t>(ranks));
  if (Status s = comm.all_gather(&mine, headers.data(), sizeof(mine)); !s.ok()) return local.ok() ? s : local;
  for (int r = 0; r < ranks; ++r) {
    const ReduceHeader& h = headers[static_cast<std::size_t>(r)];
    if (h.magic != kMagic) {
      return {Code::kInvalidUsage, "all_reduce_hidden_gradient: rank " + std::to_string(r) +
                                       " sent something else: is another collective running on the same communicator?"};
    }
    if (h.status != 0) {  // the same text on every rank, as the forward's (protocol.cc)
      if (ranks == 1) return local;
      const std::string message(h.message, strnlen(h.message, sizeof(h.message)));
      return {r == rank ? local.code() : Code::kRemoteError,
              "rank " + std::to_string(r) + " of " + std::to_string(ranks) + ": " +
                  code_name(static_cast<Code>(h.status)) + ": " + message};
    }
  }
  for (int r = 1; r < ranks; ++r) {
    const ReduceHeader& h = headers[static_cast<std::size_t>(r)];
    if (h.rows != headers[0].rows || h.cols != headers[0].cols) {
      return {Code::kInvalidUsage, "ranks disagree on grad_hidden's shape: expected rank 0's " +
                                       std::to_string(headers[0].rows) + " x " + std::to_string(headers[0].cols) +
                                       " on every rank, got " + std::to_string(h.rows) + " x " +
                                       std::to_string(h.cols) + " on rank " + std::to_string(r)};
    }
  }
  if (g.cols == 0) return {};  // H = 0 on every rank (agreed above): nothing to reduce
  for (int64_t r0 = 0; r0 < g.rows; r0 += piece_rows) {
    const int64_t rows = std::min(piece_rows, g.rows - r0);
    const int64_t count = rows * g.cols;
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(send.data() + r * g.cols, g.row<float>(r0 + r), static_cast<std::size_t>(g.cols) * sizeof(float));
    }
    if (Status s = comm.all_gather(send.data(), recv.data(), static_cast<std::size_t>(count) * sizeof(float));
        !s.ok()) {
      return s;  // rows before r0 are reduced already; these and later ones are this rank's part still
    }
    detail::parallel_rows(rows, 0, [&](int64_t r) {
      float* out = g.row<float>(r0 + r);
      for (int64_t c = 0; c < g.cols; ++c) {
        float sum = recv[static_cast<std::size_t>(r * g.cols + c)];
        for (int k = 1; k < ranks; ++k) sum += recv[static_cast<std::size_t>(k * count + r * g.cols + c)];
        out[c] = sum;
      }
    });
  }
  return {};
}

}  // namespace vpce
