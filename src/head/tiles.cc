// head/tiles.cc: the fused head's CPU sweeps (see tiles.h).
#include "tiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#include "../cpu/dtype.h"
#include "../cpu/parallel.h"
#include "../cpu/simd_rows.h"
#include "gemm.h"

namespace vpce::detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Rows of grad_weight per GEMM of its sweep: a fixed cut, so each row's sum over the tokens
// is one GEMM of a fixed shape whatever the thread count.
constexpr int64_t kWeightPieceRows = 512;
// The backward's logit gradients of one vocabulary block are held for this many bytes of
// tokens at a time (at least one token block): its memory does not grow with N.
constexpr int64_t kGradientBufferBytes = int64_t{8} << 20;

int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

// m [rows, cols] of any dtype -> out [rows, cols] fp32, row stride cols.
void widen_rows(const RowMatrix& m, int64_t begin, int64_t rows, float* out, int num_threads) {
  const int bytes = m.dtype.bytes();
  parallel_rows(rows, num_threads, [&](int64_t r) {
    const char* src = m.base + (begin + r) * m.row_stride * bytes;
    float* dst = out + r * m.cols;
    if (m.dtype == kBFloat16) {
      widen_bf16(reinterpret_cast<const uint16_t*>(src), m.cols, dst);
    } else {
      for (int64_t c = 0; c < m.cols; ++c) dst[c] = widen(src + c * bytes, m.dtype);
    }
  });
}

// n fp32 values rounded to the values of `dtype` (bf16 or fp16), in place.
void round_to(DataType dtype, float* x, int64_t n) {
  if (dtype == kBFloat16) {
    round_to_bf16(x, n);
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] = to_float(from_float<Float16>(x[i]));
  }
}

// tile [rows, cols] (row stride ld) += bias[cols] on every row; with `rounding` (bf16 or
// fp16; fp32: none), the product rounded before, the sum after, as a bf16 or fp16 layer's
// matmul and + bias round them.
void finish_logits(float* tile, int64_t ld, int64_t rows, int64_t cols, const float* bias, DataType rounding) {
  const bool round = rounding != kFloat32;
  if (!round && bias == nullptr) return;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = tile + r * ld;
    if (round) round_to(rounding, row, cols);
    if (bias == nullptr) continue;
    for (int64_t c = 0; c < cols; ++c) row[c] += bias[c];
    if (round) round_to(rounding, row, cols);
  }
}

// value (fp32) -> element (r, c) of m, written over or added to (accumulate: m is fp32).
void store(const RowMatrix& m, bool accumulate, int64_t r, int64_t c, float value) {
  char* p = m.base + (r * m.row_stride + c) * m.dtype.bytes();
  if (accumulate) {
    *reinterpret_cast<float*>(p) += value;
  } else {
    narrow(value, p, m.dtype);
  }
}

}  // namespace

Fp32Operands::Fp32Operands(const HeadArgs& args, bool full, int num_threads)
    : args_(args),
      bf16_tiles_(args.hidden.dtype == kBFloat16 && bf16_gemm_native()),
      bf16_gradient_gemms_(bf16_tiles_ && args.bf16_logit_gradients) {
  const int64_t n = args.tokens(), h = args.hidden_size(), v = args.vocab_rows();
  if (full && args.hidden.dtype != kFloat32 && !bf16_gradient_gemms_) {
    hidden_copy_.resize(static_cast<std::size_t>(n * h));
    widen_rows(args.hidden, 0, n, hidden_copy_.data(), num_threads);
    weight_copy_.resize(static_cast<std::size_t>(v * h));
    widen_rows(args.weight, 0, v, weight_copy_.data(), num_threads);
  }
  if (args.bias.base != nullptr) {
    bias_.resize(static_cast<std::size_t>(v));
    for (int64_t c = 0; c < v; ++c) {
      bias_[static_cast<std::size_t>(c)] =
          widen(args.bias.base + c * args.bias.stride * args.bias.dtype.bytes(), args.bias.dtype);
    }
  }
}

const float* Fp32Operands::rows(const RowMatrix& m, const std::vector<float>& copy, int64_t begin, int64_t count,
                                std::vector<float>& staging, int threads, int64_t* ld) const {
  if (m.dtype == kFloat32) {
    *ld = m.row_stride;
    return m.row<float>(begin);
  }
  *ld = m.cols;
  if (!copy.empty()) return copy.data() + begin * m.cols;
  staging.resize(static_cast<std::size_t>(count * m.cols));
  widen_rows(m, begin, count, staging.data(), threads);
  return staging.data();
}

void Fp32Operands::logits_tile(int64_t row, int64_t rows, int64_t col, int64_t cols, const float* hidden, int64_t ldh,
                               const float* w, int64_t ldw, float* tile, int64_t ld) const {
  const int64_t h = args_.hidden_size();
  if (bf16_tiles_) {
    gemm_bf16(false, true, rows, cols, h, args_.hidden.row<uint16_t>(row), args_.hidden.row_stride,
              args_.weight.row<uint16_t>(col), args_.weight.row_stride, 0.0f, tile, ld);
  } else {
    gemm(false, true, rows, cols, h, hidden, ldh, w, ldw, 0.0f, tile, ld);
  }
  finish_logits(tile, ld, rows, cols, bias() != nullptr ? bias() + col : nullptr,
                args_.round_logits ? args_.hidden.dtype : kFloat32);
}

const float* Fp32Operands::hidden_rows(int64_t begin, int64_t count, std::vector<float>& staging, int threads,
                                       int64_t* ld) const {
  return rows(args_.hidden, hidden_copy_, begin, count, staging, threads, ld);
}

const float* Fp32Operands::weight_rows(int64_t begin, int64_t count, std::vector<float>& staging, int threads,
                                       int64_t* ld) const {
  return rows(args_.weight, weight_copy_, begin, count, staging, threads, ld);
}

void sweep_stats(const HeadArgs& args, const Fp32Operands& ops, const SweepContext& ctx, int64_t row_begin,
                 int64_t rows, float* keep, const RowMatrix& stats, HostFloats& tiles) {
  const int64_t vr = args.vocab_rows();
  const int64_t nb = args.tiles.token_block, vb = args.tiles.vocab_block;
  const int64_t token_blocks = blocks_of(rows, nb);
  const bool with_extras = stats.cols >= kStatsWidthWithExtras;
  const bool with_sum_logits = ctx.params.with_sum_logits();
  const int threads = std::max(1, std::min<int>(thread_count(ctx.num_threads), static_cast<int>(token_blocks)));
  std::vector<BlockStats> folded(static_cast<std::size_t>(rows));
  std::vector<float> target_logit(static_cast<std::size_t>(rows), kNegInf);
  float* tile_buffers = tiles.reserve(static_cast<std::size_t>(threads * nb * vb));
  std::vector<float> staging;
  std::vector<std::vector<float>> hidden_staging(static_cast<std::size_t>(threads));  // per thread
  // Tile (i, j at column v0): its GEMM from fp32 hidden and weight rows, its rows folded.
  auto tile_stats = [&](int64_t i, int worker, int64_t v0, int64_t cols, const float* hidden, int64_t ldh,
                        const float* w, int64_t ldw) {
    const int64_t r0 = i * nb, n = std::min(nb, rows - r0);
    // Always into the [Nb, Vb] buffer, as the recompute mode's backward makes its tiles: the
    // GEMM's kernel (hence the last bits) may depend on the output's row stride, and the
    // chunked mode's loss is the recompute forward's bit for bit.
    float* tile = tile_buffers + worker * nb * vb;
    const int64_t ld = vb;
    ops.logits_tile(row_begin + r0, n, v0, cols, hidden, ldh, w, ldw, tile, ld);
    if (keep != nullptr) {
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(keep + (r0 + r) * vr + v0, tile + r * ld, static_cast<std::size_t>(cols) * sizeof(float));
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const float* row = tile + r * ld;
      const int64_t token = r0 + r;
      const TransformParams transform = logit_transform(ctx.params, row_begin + token);
      fold_block(folded[static_cast<std::size_t>(token)],
                 block_stats(row, StorageType::kFloat32, cols, transform, with_sum_logits, with_extras), v0);
      const int64_t target_col = target_at(args.targets, row_begin + token) - ctx.vocab_begin - v0;
      if (target_col >= 0 && target_col < cols) {
        target_logit[static_cast<std::size_t>(token)] = transform_one(row[target_col], transform);
      }
    }
  };
  auto hidden_of = [&](int64_t i, int worker, int64_t* ldh) -> const float* {
    if (ops.bf16_tiles()) return nullptr;  // the tiles read the bf16 rows themselves
    const int64_t r0 = i * nb;
    return ops.hidden_rows(row_begin + r0, std::min(nb, rows - r0), hidden_staging[static_cast<std::size_t>(worker)], 1,
                           ldh);
  };
  if (ops.bf16_tiles() || ops.weight_in_fp32()) {
    // Nothing to convert: each thread takes whole token blocks and sweeps the vocabulary
    // blocks in order, with no barrier between them (the same tiles, the same fold order).
    parallel_rows_on_workers(token_blocks, threads, [&](int64_t i, int worker) {
      int64_t ldh = 0;
      const float* hidden = hidden_of(i, worker, &ldh);
      for (int64_t v0 = 0; v0 < vr; v0 += vb) {
        const int64_t cols = valid_columns(ctx.vocab_begin + v0, std::min(vb, vr - v0), ctx.params);
        if (cols == 0) break;  // padding (the last rows): no part in the loss
        int64_t ldw = 0;
        const float* w = ops.bf16_tiles() ? nullptr : ops.weight_rows(v0, cols, staging, 1, &ldw);
        tile_stats(i, worker, v0, cols, hidden, ldh, w, ldw);
      }
    });
  } else {
    // bf16/fp16 weight rows: converted once per vocabulary block for every token block.
    for (int64_t v0 = 0; v0 < vr; v0 += vb) {
      const int64_t cols = valid_columns(ctx.vocab_begin + v0, std::min(vb, vr - v0), ctx.params);
      if (cols == 0) continue;  // padding: no part in the loss
      int64_t ldw = 0;
      const float* w = ops.weight_rows(v0, cols, staging, threads, &ldw);
      parallel_rows_on_workers(token_blocks, threads, [&](int64_t i, int worker) {
        int64_t ldh = 0;
        const float* hidden = hidden_of(i, worker, &ldh);
        tile_stats(i, worker, v0, cols, hidden, ldh, w, ldw);
      });
    }
  }
  parallel_rows(rows, ctx.num_threads, [&](int64_t r) {
    write_token_stats(folded[static_cast<std::size_t>(r)], target_logit[static_cast<std::size_t>(r)], ctx.vocab_begin,
                      ctx.params, stats.cols, stats.row<float>(r));
  });
}

namespace {

// The logit gradients dx as the gradients' GEMMs read them (prepare_logit_gradients): fp32
// rows of row stride ld, or those rows rounded to bf16 and compacted into the first half of
// their bytes (bf16 rows of row stride 2 ld).
struct LogitGradients {
  const char* base = nullptr;
  int64_t ld = 0;  // the fp32 rows' stride
  bool bf16 = false;
  int64_t bf16_ld() const { return 2 * ld; }
  const float* fp32_at(int64_t r, int64_t c) const { return reinterpret_cast<const float*>(base) + r * ld + c; }
  const uint16_t* bf16_at(int64_t r, int64_t c) const {
    return reinterpret_cast<const uint16_t*>(base) + r * bf16_ld() + c;
  }
};

// The logit gradients at dx (fp32 row stride ld) as prepare_logit_gradients leaves them.
LogitGradients logit_gradients(const Fp32Operands& ops, const float* dx, int64_t ld) {
  return {reinterpret_cast<const char*>(dx), ld, ops.bf16_gradient_gemms()};
}

// dx [rows, cols] fp32 (row stride ld), in place, as the gradients' GEMMs take it: unchanged;
// with bf16_logit_gradients rounded to bf16, compacted to bf16 rows where those GEMMs are
// bf16 (Fp32Operands::bf16_gradient_gemms), else kept as fp32 values.
LogitGradients prepare_logit_gradients(const HeadArgs& args, const Fp32Operands& ops, float* dx, int64_t ld,
                                       int64_t rows, int64_t cols) {
  if (args.bf16_logit_gradients) {
    for (int64_t r = 0; r < rows; ++r) {
      float* row = dx + r * ld;
      if (ops.bf16_gradient_gemms()) {
        narrow_bf16(row, cols, reinterpret_cast<uint16_t*>(row));
      } else {
        round_to_bf16(row, cols);
      }
    }
  }
  return logit_gradients(ops, dx, ld);
}

// out [rows, H] = dx [rows, cols] times the weight's rows [v0, v0 + cols) + beta out: their fp32
// copy `w` (row stride ldw), or the bf16 rows themselves when dx is bf16.
void hidden_gradient(const HeadArgs& args, const LogitGradients& dx, int64_t rows, int64_t v0, int64_t cols,
                     const float* w, int64_t ldw, float beta, float* out, int64_t ldo) {
  const int64_t h = args.hidden_size();
  if (dx.bf16) {
    gemm_bf16(false, false, rows, h, cols, dx.bf16_at(0, 0), dx.bf16_ld(), args.weight.row<uint16_t>(v0),
              args.weight.row_stride, beta, out, ldo);
  } else {
    gemm(false, false, rows, h, cols, dx.fp32_at(0, 0), dx.ld, w, ldw, beta, out, ldo);
  }
}

// sums[0, count) = the column sums of dx's columns [c0, c0 + count) over its rows [0, rows),
// in row order, in fp64; with `adds`, those sums added to the old values.
void column_sums(const LogitGradients& dx, int64_t rows, int64_t c0, int64_t count, bool adds, double* sums) {
  thread_local std::vector<double> fresh;
  fresh.assign(static_cast<std::size_t>(count), 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    if (dx.bf16) {
      const uint16_t* row = dx.bf16_at(t, c0);
      for (int64_t c = 0; c < count; ++c)
        fresh[static_cast<std::size_t>(c)] += static_cast<double>(to_float(BFloat16{row[c]}));
    } else {
      const float* row = dx.fp32_at(t, c0);
      for (int64_t c = 0; c < count; ++c) fresh[static_cast<std::size_t>(c)] += static_cast<double>(row[c]);
    }
  }
  for (int64_t c = 0; c < count; ++c) {
    const double sum = fresh[static_cast<std::size_t>(c)];
    sums[c] = adds ? sums[c] + sum : sum;
  }
}

// grad_weight rows [0, count) and grad_bias from the logit gradients dx of `tokens` token
// rows, the hidden states of hidden's rows [row0, row0 + tokens) (their fp32 copy `hidden`,
// row stride ldh, or the bf16 rows themselves when dx is bf16): out = dx^T h, in pieces of
// kWeightPieceRows spread over the threads. `beta` 0 writes grad_weight's rows, 1 adds to
// them; `bias_adds` likewise for the bias sums.
struct WeightTarget {
  float* data;  // fp32 rows [V_r, H] to write or add into; null when grad_weight is not wanted
  int64_t ld;
  double* bias;  // fp64 [V_r] to write or add into; null when grad_bias is not wanted
};

void weight_gradient(const HeadArgs& args, const LogitGradients& dx, int64_t row0, int64_t tokens, const float* hidden,
                     int64_t ldh, int64_t count, float beta, bool bias_adds, const WeightTarget& target,
                     int num_threads) {
  const int64_t h = args.hidden_size();
  const int64_t pieces = blocks_of(count, kWeightPieceRows);
  parallel_rows(pieces, num_threads, [&](int64_t p) {
    const int64_t c0 = p * kWeightPieceRows, n = std::min(kWeightPieceRows, count - c0);
    if (target.data != nullptr) {
      float* out = target.data + c0 * target.ld;
      if (dx.bf16) {
        gemm_bf16(true, false, n, h, tokens, dx.bf16_at(0, c0), dx.bf16_ld(), args.hidden.row<uint16_t>(row0),
                  args.hidden.row_stride, beta, out, target.ld);
      } else {
        gemm(true, false, n, h, tokens, dx.fp32_at(0, c0), dx.ld, hidden, ldh, beta, out, target.ld);
      }
    }
    if (target.bias != nullptr) column_sums(dx, tokens, c0, n, bias_adds, target.bias + c0);
  });
}

// rows [row0, row0 + rows) of a [*, H] gradient: from fp32 `sums` (row stride ld) into m.
void store_rows(const RowMatrix& m, bool accumulate, int64_t row0, int64_t rows, const float* sums, int64_t ld,
                int num_threads) {
  parallel_rows(rows, num_threads, [&](int64_t r) {
    for (int64_t c = 0; c < m.cols; ++c) store(m, accumulate, row0 + r, c, sums[r * ld + c]);
  });
}

// Rows [row0, row0 + rows) of m set to zero (written over; nothing to do when accumulating).
void zero_rows(const GradientArgs& g, int64_t row0, int64_t rows, int num_threads) {
  if (!g.present() || g.accumulate) return;
  parallel_rows(rows, num_threads, [&](int64_t r) {
    for (int64_t c = 0; c < g.matrix.cols; ++c) store(g.matrix, false, row0 + r, c, 0.0f);
  });
}

}  // namespace

TileGradient loss_tile_gradient(const HeadArgs& args, const SweepContext& ctx, const TokenVector& lse,
                                const Upstream& upstream) {
  return [&args, &ctx, lse, upstream](const RowMatrix& x, int64_t r0, int64_t vocab_begin) {
    Upstream up = upstream;
    up.per_token = token_slice(upstream.per_token, r0, x.rows);
    gradient_rows_kernel(x, token_slice(args.targets, r0, x.rows), token_slice(args.weights, r0, x.rows),
                         token_slice(lse, r0, x.rows), up, vocab_begin, ctx.params, 1, x);
  };
}

void sweep_gradients(const HeadArgs& args, const Fp32Operands& ops, const SweepContext& ctx,
                     const TileGradient& gradient, const HeadGradientArgs& grads, HostFloats& buffer) {
  const int64_t n = args.tokens(), h = args.hidden_size(), vr = args.vocab_rows();
  const int64_t nb = args.tiles.token_block, vb = args.tiles.vocab_block;
  const int threads = thread_count(ctx.num_threads);
  // grad_hidden accumulates over the vocabulary blocks in fp32: in grad_hidden itself when it
  // is fp32, else in a buffer written out at the end.
  const bool hidden_direct = grads.hidden.present() && grads.hidden.matrix.dtype == kFloat32;
  std::vector<float> hidden_sum(grads.hidden.present() && !hidden_direct ? static_cast<std::size_t>(n * h) : 0);
  float* dh = hidden_direct ? grads.hidden.matrix.row<float>(0) : hidden_sum.data();
  const int64_t lddh = hidden_direct ? grads.hidden.matrix.row_stride : h;
  bool dh_started = grads.hidden.accumulate && hidden_direct;
  // grad_weight and grad_bias rows: straight into grad_weight when fp32, else through a
  // [Vb, H] buffer written out once per vocabulary block.
  const bool weight_direct = grads.weight.present() && grads.weight.matrix.dtype == kFloat32;
  std::vector<float> weight_block(grads.weight.present() && !weight_direct ? static_cast<std::size_t>(vb * h) : 0);
  std::vector<double> bias_block(grads.bias.present() ? static_cast<std::size_t>(vb) : 0);
  // A super-block's logit gradients, and for bf16/fp16 its hidden states in fp32 (unless the
  // GEMMs take the bf16 rows), fit the buffer.
  const bool hidden_widened = args.hidden.dtype != kFloat32 && !ops.bf16_gradient_gemms();
  const int64_t token_bytes = (vb + (hidden_widened ? h : 0)) * 4;
  const int64_t group = std::max<int64_t>(1, kGradientBufferBytes / (token_bytes * nb)) * nb;
  float* dx = buffer.reserve(static_cast<std::size_t>(std::min(group, n) * vb));
  std::vector<float> group_staging;
  std::vector<double> bias_parts(grads.bias.present() ? static_cast<std::size_t>((group / nb) * vb) : 0);
  std::vector<float> staging;
  for (int64_t v0 = 0; v0 < vr; v0 += vb) {
    const int64_t width = std::min(vb, vr - v0);
    const int64_t cols = valid_columns(ctx.vocab_begin + v0, width, ctx.params);
    if (cols == 0) {  // padding rows of the weight: a zero gradient
      zero_rows(grads.weight, v0, width, threads);
      zero_rows(grads.bias, v0, width, threads);
      continue;
    }
    int64_t ldw = 0;
    const float* w = ops.bf16_gradient_gemms() ? nullptr : ops.weight_rows(v0, cols, staging, threads, &ldw);
    const float beta_h = dh_started ? 1.0f : 0.0f;
    const WeightTarget target{!grads.weight.present() ? nullptr
                              : weight_direct         ? grads.weight.matrix.row<float>(v0)
                                                      : weight_block.data(),
                              weight_direct ? grads.weight.matrix.row_stride : h, nullptr};
    // The tokens in super-blocks of `group` rows whose logit gradients fit the buffer; the
    // weight's gradient sums them in super-block order (no tokens: one empty super-block,
    // which writes the zero sums).
    int64_t s0 = 0;
    do {
      const int64_t group_rows = std::min(group, n - s0);
      // The super-block's hidden states in fp32 (converted once for its tiles and its weight
      // gradient when bf16/fp16; not at all when every GEMM takes the bf16 rows).
      int64_t ldh = 0;
      const float* hidden =
          ops.bf16_gradient_gemms() ? nullptr : ops.hidden_rows(s0, group_rows, group_staging, threads, &ldh);
      parallel_rows(blocks_of(group_rows, nb), threads, [&](int64_t i) {
        const int64_t r0 = s0 + i * nb, rows = std::min(nb, n - r0);
        float* tile = dx + (r0 - s0) * vb;
        ops.logits_tile(r0, rows, v0, cols, hidden != nullptr ? hidden + (r0 - s0) * ldh : nullptr, ldh, w, ldw, tile,
                        vb);
        const RowMatrix x{reinterpret_cast<char*>(tile), kFloat32, rows, width, vb};
        gradient(x, r0, ctx.vocab_begin + v0);
        const LogitGradients g = prepare_logit_gradients(args, ops, tile, vb, rows, cols);
        if (grads.hidden.present()) hidden_gradient(args, g, rows, v0, cols, w, ldw, beta_h, dh + r0 * lddh, lddh);
        // The block's column sums while its tile is in cache.
        if (grads.bias.present()) column_sums(g, rows, 0, cols, false, bias_parts.data() + i * vb);
      });
      if (grads.bias.present()) {  // the blocks' sums in token order
        for (int64_t i = 0; i < blocks_of(group_rows, nb); ++i) {
          const double* part = bias_parts.data() + i * vb;
          for (int64_t c = 0; c < cols; ++c) bias_block[c] = s0 == 0 && i == 0 ? part[c] : bias_block[c] + part[c];
        }
      }
      if (grads.weight.present()) {
        // The first super-block writes the sums (over grad_weight itself, unless adding into it).
        const float beta_w = s0 > 0 || (weight_direct && grads.weight.accumulate) ? 1.0f : 0.0f;
        weight_gradient(args, logit_gradients(ops, dx, vb), s0, group_rows, hidden, ldh, cols, beta_w, false, target,
                        threads);
      }
      s0 += group;
    } while (s0 < n);
    dh_started = true;
    if (grads.weight.present() && !weight_direct) {
      store_rows(grads.weight.matrix, grads.weight.accumulate, v0, cols, weight_block.data(), h, threads);
    }
    zero_rows(grads.weight, v0 + cols, width - cols, threads);
    if (grads.bias.present()) {
      for (int64_t c = 0; c < cols; ++c) {
        store(grads.bias.matrix, grads.bias.accumulate, v0 + c, 0, static_cast<float>(bias_block[c]));
      }
      zero_rows(grads.bias, v0 + cols, width - cols, threads);
    }
  }
  if (grads.hidden.present()) {
    if (!dh_started) {  // no vocabulary rows: dx is empty, the gradient zero
      zero_rows(grads.hidden, 0, n, threads);
    } else if (!hidden_direct) {
      store_rows(grads.hidden.matrix, grads.hidden.accumulate, 0, n, hidden_sum.data(), h, threads);
    }
  }
}

Status head_out_of_memory(const char* call) {
  return {Code::kSystemError, std::string(call) + ": could not allocate the tiles' buffers"};
}

Status exchange_head_stats(Communicator& comm, Workspace::Buffers& buffers, const ExchangeCall& call,
                           const Status& local, const HeadArgs& args, const Fp32Operands* ops, const SweepContext& ctx,
                           int64_t row_begin, int64_t rows, float* keep, const char* function, RowMatrix* merged) {
  return exchange_stats(
      comm, buffers, call, local,
      [&](const RowMatrix& stats) -> Status {
        try {
          sweep_stats(args, *ops, ctx, row_begin, rows, keep, stats, buffers.head_tiles);
        } catch (const std::bad_alloc&) {
          return head_out_of_memory(function);
        }
        return {};
      },
      merged);
}

float* reserve_chunked(const HeadArgs& args, const HeadGradientArgs& grads, int64_t chunk_tokens, HostFloats& logits,
                       ChunkedSums& sums) {
  float* x = logits.reserve(static_cast<std::size_t>(std::min(chunk_tokens, args.tokens()) * args.vocab_rows()));
  sums.weight_direct = grads.weight.present() && grads.weight.matrix.dtype == kFloat32;
  if (grads.weight.present() && !sums.weight_direct) {
    sums.weight.resize(static_cast<std::size_t>(args.vocab_rows() * args.hidden_size()));
  }
  if (grads.bias.present()) sums.bias.resize(static_cast<std::size_t>(args.vocab_rows()));
  return x;
}

void chunk_gradients(const HeadArgs& args, const Fp32Operands& ops, const SweepContext& ctx, int64_t row_begin,
                     int64_t rows, float* logits, const TileGradient& gradient, const HeadGradientArgs& grads,
                     bool first_chunk, ChunkedSums& sums) {
  const int64_t h = args.hidden_size(), vr = args.vocab_rows();
  const int64_t nb = args.tiles.token_block;
  const int64_t token_blocks = blocks_of(rows, nb);
  const int threads = thread_count(ctx.num_threads);
  const int64_t cols = valid_columns(ctx.vocab_begin, vr, ctx.params);
  std::vector<float> unused;
  int64_t ldw = 0;
  const float* w = cols > 0 && !ops.bf16_gradient_gemms() ? ops.weight_rows(0, cols, unused, threads, &ldw) : nullptr;
  const bool hidden_direct = grads.hidden.present() && grads.hidden.matrix.dtype == kFloat32;
  std::vector<float> hidden_out(grads.hidden.present() && !hidden_direct
                                    ? static_cast<std::size_t>(std::min<int>(threads, token_blocks) * nb * h)
                                    : 0);
  parallel_rows_on_workers(token_blocks, std::min<int64_t>(threads, token_blocks), [&](int64_t i, int worker) {
    const int64_t r0 = i * nb, n = std::min(nb, rows - r0);
    const int64_t token = row_begin + r0;
    float* x = logits + r0 * vr;
    const RowMatrix m{reinterpret_cast<char*>(x), kFloat32, n, vr, vr};
    gradient(m, token, ctx.vocab_begin);
    const LogitGradients g = prepare_logit_gradients(args, ops, x, vr, n, cols);
    if (!grads.hidden.present()) return;
    if (cols == 0) {
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < h; ++c) store(grads.hidden.matrix, grads.hidden.accumulate, token + r, c, 0.0f);
      }
      return;
    }
    if (hidden_direct) {
      hidden_gradient(args, g, n, 0, cols, w, ldw, grads.hidden.accumulate ? 1.0f : 0.0f,
                      grads.hidden.matrix.row<float>(token), grads.hidden.matrix.row_stride);
    } else {
      float* out = hidden_out.data() + worker * nb * h;
      hidden_gradient(args, g, n, 0, cols, w, ldw, 0.0f, out, h);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < h; ++c)
          store(grads.hidden.matrix, grads.hidden.accumulate, token + r, c, out[r * h + c]);
      }
    }
  });
  if (!grads.weight.present() && !grads.bias.present()) return;
  const WeightTarget target{!grads.weight.present() ? nullptr
                            : sums.weight_direct    ? grads.weight.matrix.row<float>(0)
                                                    : sums.weight.data(),
                            sums.weight_direct ? grads.weight.matrix.row_stride : h,
                            grads.bias.present() ? sums.bias.data() : nullptr};
  // The first chunk writes the sums (over grad_weight itself, unless accumulating into it).
  const float beta_w = first_chunk && !(sums.weight_direct && grads.weight.accumulate) ? 0.0f : 1.0f;
  int64_t ldh = 0;
  const float* hidden = ops.bf16_gradient_gemms() ? nullptr : ops.hidden_rows(row_begin, rows, unused, threads, &ldh);
  weight_gradient(args, logit_gradients(ops, logits, vr), row_begin, rows, hidden, ldh, cols, beta_w, !first_chunk,
                  target, threads);
}

void finish_chunked_gradients(const HeadArgs& args, const SweepContext& ctx, const HeadGradientArgs& grads,
                              ChunkedSums& sums) {
  const int64_t h = args.hidden_size(), vr = args.vocab_rows();
  const int threads = thread_count(ctx.num_threads);
  const int64_t cols = valid_columns(ctx.vocab_begin, vr, ctx.params);
  if (grads.weight.present() && !sums.weight_direct) {
    store_rows(grads.weight.matrix, grads.weight.accumulate, 0, cols, sums.weight.data(), h, threads);
  }
  zero_rows(grads.weight, cols, vr - cols, threads);
  if (grads.bias.present()) {
    for (int64_t c = 0; c < cols; ++c) {
      store(grads.bias.matrix, grads.bias.accumulate, c, 0, static_cast<float>(sums.bias[static_cast<std::size_t>(c)]));
    }
    zero_rows(grads.bias, cols, vr - cols, threads);
  }
}

}  // namespace vpce::detail
