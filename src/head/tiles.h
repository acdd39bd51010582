// head/tiles.h: the fused head's CPU sweeps over logit tiles, on validated arguments.
//
// A tile is x[i-block, j-block] = h_i W_j^T + b_j, [Nb, Vb] fp32, from one single-threaded
// GEMM (gemm.h). The vocabulary blocks j run in order; within a j the token blocks i are
// spread over the threads (each block on one thread), so every token's statistics fold
// the tiles in column order, every GEMM has a shape fixed by the tile sizes, and the
// results are the same for any thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "../cpu/kernels.h"
#include "../exchange.h"
#include "../workspace.h"
#include "head_args.h"

namespace vpce::detail {

// What a sweep needs besides the operands.
struct SweepContext {
  int64_t vocab_begin = 0;  // the shard's first global column
  LossParams params;
  int num_threads = 0;
};

// The operands as fp32 rows: the inputs themselves when fp32; else, for bf16 and fp16,
// converted copies: all of them when `full` (the chunked mode), else a block at a time into
// the caller's staging buffer inside the sweeps. Holds the full copies and the bias. bf16
// operands on a CPU with bf16 dot products (bf16_gemm_native) give the logits' tiles
// straight from their bf16 rows (gemm_bf16); the fp32 rows then serve the gradients'
// GEMMs only, unless those run in bf16 too (bf16_gradient_gemms).
class Fp32Operands {
 public:
  Fp32Operands(const HeadArgs& args, bool full, int num_threads);
  // Hidden rows [begin, begin + count) / weight rows [begin, begin + count) in fp32
  // (converted into `staging`, [count, H], on `threads` threads, when needed), and their
  // row stride.
  const float* hidden_rows(int64_t begin, int64_t count, std::vector<float>& staging, int threads, int64_t* ld) const;
  const float* weight_rows(int64_t begin, int64_t count, std::vector<float>& staging, int threads, int64_t* ld) const;
  const float* bias() const { return bias_.empty() ? nullptr : bias_.data(); }
  // Whether weight_rows() hands out the weight's rows without converting them.
  bool weight_in_fp32() const { return args_.weight.dtype == kFloat32 || !weight_copy_.empty(); }
  // Whether the logits' tiles come from the bf16 operands themselves (decided once per call,
  // so that a backward's tiles are its forward's).
  bool bf16_tiles() const { return bf16_tiles_; }
  // Whether the gradients' GEMMs take bf16 operands: bf16_logit_gradients with bf16 tiles.
  // Then dx is compacted to bf16 rows and meets the bf16 rows of hidden and weight (no fp32
  // copies of those are made); with bf16_logit_gradients on a CPU without bf16 dot products
  // dx is rounded to bf16's values in fp32 and the GEMMs stay fp32.
  bool bf16_gradient_gemms() const { return bf16_gradient_gemms_; }
  // tile [rows, cols] (row stride ld) = hidden rows [row, row + rows) times weight rows
  // [col, col + cols) transposed, plus the bias of those columns: from the bf16 operands when
  // bf16_tiles(), else from their fp32 rows `hidden` (row stride ldh) and `w` (ldw), which
  // may then be null. With round_logits, rounded to the operands' dtype as a bf16 or fp16
  // layer rounds them: the product, then its sum with the bias.
  void logits_tile(int64_t row, int64_t rows, int64_t col, int64_t cols, const float* hidden, int64_t ldh,
                   const float* w, int64_t ldw, float* tile, int64_t ld) const;

 private:
  const float* rows(const RowMatrix& m, const std::vector<float>& copy, int64_t begin, int64_t count,
                    std::vector<float>& staging, int threads, int64_t* ld) const;
  const HeadArgs& args_;
  std::vector<float> hidden_copy_, weight_copy_, bias_;
  bool bf16_tiles_ = false;
  bool bf16_gradient_gemms_ = false;
};

// Token rows [row_begin, row_begin + rows) -> their [rows, W] statistics (as
// local_stats_kernel of their logits). Each tile is made in a per-thread [Nb, Vb] buffer
// taken from `tiles`; with `keep` ([rows, V_r] fp32, row stride V_r) it is also copied there
// (chunked mode; padding columns are not written), else dropped.
void sweep_stats(const HeadArgs& args, const Fp32Operands& ops, const SweepContext& ctx, int64_t row_begin,
                 int64_t rows, float* keep, const RowMatrix& stats, HostFloats& tiles);

// `call`'s error for buffers it could not allocate.
Status head_out_of_memory(const char* call);

// A forward's one gather of token rows [row_begin, row_begin + rows) (exchange.h): this
// rank's statistics swept from its tiles (sweep_stats, kept in `keep` when not null) when its
// own check `local` passed (`ops` then holds the operands); `function` names an allocation
// failure. On success *merged views the merged statistics.
Status exchange_head_stats(Communicator& comm, Workspace::Buffers& buffers, const ExchangeCall& call,
                           const Status& local, const HeadArgs& args, const Fp32Operands* ops, const SweepContext& ctx,
                           int64_t row_begin, int64_t rows, float* keep, const char* function, RowMatrix* merged);

// Turns a tile of logits x (token rows [r0, r0 + x.rows), the shard's columns from
// vocab_begin) into their gradient in place: the operation's gradient rows (the loss's,
// loss_tile_gradient; the RL outputs' in src/rl/).
using TileGradient = std::function<void(const RowMatrix& x, int64_t r0, int64_t vocab_begin)>;
// The loss's: gradient_rows_kernel with the tokens' lse and upstream gradients.
TileGradient loss_tile_gradient(const HeadArgs& args, const SweepContext& ctx, const TokenVector& lse,
                                const Upstream& upstream);

// Recompute mode's backward over every token: for each vocabulary block j, the tiles
// recomputed and turned into their logit gradients dx in a buffer of a few MiB taken from
// `buffer` (a super-block of tokens at a time), grad_hidden += dx W_j per token block, and
// grad_weight_j, grad_bias_j += dx^T h, column sums per super-block in token order.
void sweep_gradients(const HeadArgs& args, const Fp32Operands& ops, const SweepContext& ctx,
                     const TileGradient& gradient, const HeadGradientArgs& grads, HostFloats& buffer);

// Chunked mode: the gradients of token rows [row_begin, row_begin + rows) whose logits are
// in `logits` ([rows, V_r], from sweep_stats), turned into their gradients in place.
// grad_hidden's rows are written (or added to); grad_weight and grad_bias are summed over
// the chunks into `weight_sum` ([V_r, H] fp32 for a non-fp32 or written-over grad_weight,
// else grad_weight itself) and `bias_sum` ([V_r] fp64), starting from zero at the first
// chunk. finish_chunked_gradients writes them out after the last chunk.
struct ChunkedSums {
  std::vector<float> weight;   // [V_r, H] when grad_weight is not fp32
  std::vector<double> bias;    // [V_r]
  bool weight_direct = false;  // sums added into grad_weight itself
};
// Before the first gather: the chunk's logits, [min(chunk_tokens, N), V_r] fp32 taken from
// `logits`, and the sums' storage for these gradients. Throws std::bad_alloc.
float* reserve_chunked(const HeadArgs& args, const HeadGradientArgs& grads, int64_t chunk_tokens, HostFloats& logits,
                       ChunkedSums& sums);
void chunk_gradients(const HeadArgs& args, const Fp32Operands& ops, const SweepContext& ctx, int64_t row_begin,
                     int64_t rows, float* logits, const TileGradient& gradient, const HeadGradientArgs& grads,
                     bool first_chunk, ChunkedSums& sums);
void finish_chunked_gradients(const HeadArgs& args, const SweepContext& ctx, const HeadGradientArgs& grads,
                              ChunkedSums& sums);

}  // namespace vpce::detail
