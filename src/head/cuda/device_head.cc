// head/cuda/device_head.cc: the fused head on CUDA tensors (see head/device_head.h): cuBLAS
// GEMMs per tile into an fp32 buffer, head_kernels.cu's epilogues, and the forward's exact
// protocol of cuda/dispatch.cu (the same RankHeader with the head's operation block, the same device
// gather, group check, merge and loss, the same asynchronous errors read by
// Workspace::device_status()).
//
// Tiles. Rank r's V_r weight rows are cut into vocabulary panels of Vb rows at fixed
// offsets, the tokens into blocks of Nb. Tile (i, j) is z = h_i W_j^T, an fp32 [nb, vb]
// GEMM (cublasGemmEx, fp32 compute, fp32/bf16/fp16 operands, no TF32) with row stride vb,
// always issued with the same shape and operands, in the forward, the backward's recompute
// and the chunked mode, so that they see the same logits (cuBLAS is deterministic for the
// same call; its choice of kernel may also depend on the output's alignment, which is 256
// bytes for every tile in every mode when Nb is a multiple of 64 or covers every token, as
// the defaults do). Every token's statistics are folded panel after panel (column order).
// The backward holds an fp32 [N, Vb] panel of logit gradients; the chunked mode a
// [chunk, V_r] block of logits, laid out panel by panel.
//
// The GPU's default tiles differ from the CPU's (HeadOptions fields left 0): Vb up to 4096
// and Nb such that a panel [N, Vb] and a tile [Nb, Vb] (recompute mode) or a block
// [chunk, V_r] (chunked mode) hold at most 64 Mi floats (256 MiB), so that each GEMM is
// large enough for the device.
//
// Backward GEMMs, fp32 accumulation in a fixed order (no atomics):
//   grad_hidden += dz_j W_j over the panels j in order (beta 0 for the first unless
//   accumulating); grad_weight_j = dz_j^T h (one GEMM over all N tokens; the chunked mode
//   adds chunk after chunk); grad_bias_j = dz_j's column sums (fp64, fixed segments).
// cuBLAS's GEMMs take one dtype for both operands, so the fp32 dz meets the operands as:
//   fp32: fp32 GEMMs; bf16: dz split in two bf16 parts (hi = bf16(dz), lo = bf16(dz - hi),
//   16 significant bits, a relative error below 2^-16 per element), two tensor-core GEMMs
//   into the same fp32 sum, or with HeadOptions::bf16_logit_gradients hi alone (one GEMM,
//   and dz itself rounded so that the bias sums see the same values); fp16: the operands
//   widened to fp32 (exact) and fp32 GEMMs.
//
// Nothing synchronises with the host when a Workspace is given: buffers and the cuBLAS
// handle live in it (Workspace::Buffers::device_head), grown with cudaMallocAsync and then
// reused, so that a second call of the same sizes can be captured in a CUDA graph.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../../cuda/device.h"
#include "../../cuda/dispatch.h"
#include "../../cuda/host.h"
#include "../../exchange.h"
#include "../../protocol.h"
#include "../../validate.h"
#include "../../workspace.h"
#include "../device_head.h"
#include "../head_args.h"
#include "head_kernels.h"

namespace vpce::detail {
namespace head_cuda {
namespace {

// The GPU's default tiles (HeadOptions fields left 0): an fp32 tile or panel of at most
// kBudget floats (256 MiB).
constexpr int64_t kBudget = int64_t{64} << 20;
constexpr int64_t kMaxDefaultVocabBlock = 4096;
constexpr int64_t kMinDefaultVocabBlock = 256;
constexpr std::size_t kCublasWorkspace = std::size_t{32} << 20;  // cuBLAS's recommendation on Hopper
constexpr std::size_t kAlign = 256;

Status cublas_failure(const char* what, cublasStatus_t e) {
  return {Code::kSystemError, std::string("cublas: ") + what + ": " + cublasGetStatusString(e)};
}

std::size_t round_up(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

Status refuse_while_capturing(const char* what) {
  return {Code::kInvalidUsage, std::string("workspace: expected ") + what +
                                   " already made when capturing a CUDA graph (run one call of this size first), "
                                   "got a call that needs more"};
}

struct Buffer {
  char* p = nullptr;
  std::size_t capacity = 0;
};

// The fused head's device buffers and cuBLAS handle, kept in Workspace::Buffers::device_head.
struct HeadBuffers {
  int device = -1;
  cublasHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;  // of the last call
  CallOrder order;                // of the calls on these buffers
  Buffer cublas, running, tile, hi, lo, hidden32, weight32, grad_hidden32, grad_weight32, bias_sums, partial, upstream;

  Buffer* all() { return &cublas; }
  static constexpr int kBuffers = 12;

  HeadBuffers() = default;
  HeadBuffers(const HeadBuffers&) = delete;
  HeadBuffers& operator=(const HeadBuffers&) = delete;
  // Waits for the last call's work, which may still use the buffers, then frees them.
  ~HeadBuffers() {
    if (device < 0) return;
    CurrentDevice current(device);
    order.wait();
    Buffer* b = all();
    for (int k = 0; k < kBuffers; ++k) {
      if (b[k].p != nullptr) cudaFree(b[k].p);
    }
    if (handle != nullptr) cublasDestroy(handle);
  }

  // Grows `b` to `bytes` on `stream` (not while it is captured).
  Status grow(Buffer& b, std::size_t bytes) {
    if (bytes <= b.capacity) return {};
    bool captured = false;
    if (Status s = is_capturing(stream, &captured); !s.ok()) return s;
    if (captured) return refuse_while_capturing("device buffers");
    if (b.p != nullptr) {
      if (const cudaError_t e = cudaFreeAsync(b.p, stream); e != cudaSuccess) return cuda_failure("cudaFreeAsync", e);
    }
    b = Buffer{};
    if (const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&b.p), bytes, stream); e != cudaSuccess) {
      return cuda_failure("cudaMallocAsync of the fused head's workspace", e);
    }
    b.capacity = bytes;
    return {};
  }

  template <class T>
  T* as(const Buffer& b) const {
    return reinterpret_cast<T*>(b.p);
  }
};

// The head's buffers of `state` for a call on `stream` (the caller made `device` current):
// ordered after the last call, the cuBLAS handle made (not while capturing), on `stream`,
// with its own workspace.
Status begin(std::shared_ptr<void>* state, int device, cudaStream_t stream, HeadBuffers** out) {
  if (!*state) *state = std::make_shared<HeadBuffers>();
  auto& b = *static_cast<HeadBuffers*>(state->get());
  if (b.device >= 0 && b.device != device) {
    return {Code::kInvalidUsage, "workspace: expected the device of its first fused-head call, cuda:" +
                                     std::to_string(b.device) + ", got cuda:" + std::to_string(device)};
  }
  // The last call may have run on another stream and still use these buffers.
  if (Status s = b.order.before(stream); !s.ok()) return s;
  b.device = device;
  b.stream = stream;
  if (b.handle == nullptr) {
    bool captured = false;
    if (Status s = is_capturing(stream, &captured); !s.ok()) return s;
    if (captured) return refuse_while_capturing("a cuBLAS handle");
    if (const cublasStatus_t e = cublasCreate(&b.handle); e != CUBLAS_STATUS_SUCCESS) {
      b.handle = nullptr;
      return cublas_failure("cublasCreate", e);
    }
    // fp32 means fp32: no TF32, no reduced-precision reductions.
    if (const cublasStatus_t e = cublasSetMathMode(
            b.handle,
            static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
        e != CUBLAS_STATUS_SUCCESS) {
      return cublas_failure("cublasSetMathMode", e);
    }
  }
  if (Status s = b.grow(b.cublas, kCublasWorkspace); !s.ok()) return s;
  // cublasSetStream resets the workspace: set it after. A workspace of our own keeps the
  // GEMMs deterministic and lets them be captured.
  if (const cublasStatus_t e = cublasSetStream(b.handle, stream); e != CUBLAS_STATUS_SUCCESS) {
    return cublas_failure("cublasSetStream", e);
  }
  if (const cublasStatus_t e = cublasSetWorkspace(b.handle, b.cublas.p, b.cublas.capacity);
      e != CUBLAS_STATUS_SUCCESS) {
    return cublas_failure("cublasSetWorkspace", e);
  }
  *out = &b;
  return {};
}

cudaDataType_t cuda_type(DataType d) { return d == kFloat32 ? CUDA_R_32F : d == kBFloat16 ? CUDA_R_16BF : CUDA_R_16F; }

// A GEMM operand: row-major, row stride ld elements.
struct Operand {
  const void* p;
  cudaDataType_t type;
  int64_t ld;
};

// Row-major C[m, n] (fp32, row stride ldc) = op(A) op(B) + beta C, op(A) [m, k] (A stored
// [k, m] when trans_a), op(B) [k, n] (B stored [n, k] when trans_b); beta 0 or 1. In
// cuBLAS's column-major terms: C^T = op(B)^T op(A)^T.
Status gemm(cublasHandle_t handle, cudaStream_t stream, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
            const Operand& a, const Operand& b, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return {};
  if (k == 0) {
    if (beta != 0.0f) return {};
    const cudaError_t e =
        cudaMemset2DAsync(c, static_cast<std::size_t>(ldc) * sizeof(float), 0,
                          static_cast<std::size_t>(n) * sizeof(float), static_cast<std::size_t>(m), stream);
    return e == cudaSuccess ? Status{} : cuda_failure("cudaMemset2DAsync", e);
  }
  const float alpha = 1.0f;
  const cublasStatus_t e = cublasGemmEx(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, b.p, b.type, static_cast<int>(b.ld), a.p, a.type,
      static_cast<int>(a.ld), &beta, c, CUDA_R_32F, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return e == CUBLAS_STATUS_SUCCESS ? Status{} : cublas_failure("cublasGemmEx", e);
}

Status zero_matrix(float* c, int64_t rows, int64_t cols, int64_t ld, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return {};
  const cudaError_t e =
      cudaMemset2DAsync(c, static_cast<std::size_t>(ld) * sizeof(float), 0,
                        static_cast<std::size_t>(cols) * sizeof(float), static_cast<std::size_t>(rows), stream);
  return e == cudaSuccess ? Status{} : cuda_failure("cudaMemset2DAsync", e);
}

TokenVector slice(const TokenVector& v, int64_t begin, int64_t count) {
  TokenVector out = v;
  out.n = count;
  if (v.base != nullptr) out.base = v.base + begin * v.stride * v.dtype.bytes();
  return out;
}

std::string device_text(Device d) { return to_string(d); }

// ---- tiles ------------------------------------------------------------------------------

struct Tiles {
  int64_t nb = 1;     // tokens per tile
  int64_t vb = 1;     // vocabulary rows per panel
  int64_t chunk = 1;  // tokens per chunk (chunked mode), a multiple of nb
};

int64_t round_down(int64_t value, int64_t multiple) { return value / multiple * multiple; }

// The GPU's tiles: the values given (the chunk rounded down to a multiple of Nb), else tiles
// of up to kBudget fp32 elements: Vb from N (the backward's [N, Vb] panel, at most V_r); in
// the recompute mode Nb from Vb (a [Nb, Vb] tile: few, large GEMMs), the same in its forward
// and backward for the same N, V_r and options; in the chunked mode Nb and the chunk from
// `budget_rows` = ceil(V / R) vocabulary rows (a [chunk, budget_rows] block), which every
// rank agrees on, so that its gathers have the same sizes on uneven ranges too. (Where the
// two modes' tiles differ, cuBLAS may pick other kernels, and the last bits of their logits
// may differ.)
Tiles gpu_tiles(const HeadOptions& head, int64_t n, int64_t vocab_rows, int64_t budget_rows, bool chunked) {
  Tiles t;
  const int64_t tokens = std::max<int64_t>(n, 1);
  const int64_t rows = std::max<int64_t>(vocab_rows, 1);
  if (head.vocab_block > 0) {
    t.vb = head.vocab_block;
  } else {
    t.vb = std::clamp(round_down(kBudget / tokens, 64), kMinDefaultVocabBlock, kMaxDefaultVocabBlock);
  }
  t.vb = std::max<int64_t>(1, std::min(t.vb, rows));
  const int64_t fitting =
      std::max<int64_t>(64, round_down(kBudget / std::max<int64_t>(chunked ? budget_rows : t.vb, 1), 64));
  if (head.token_block > 0) {
    t.nb = head.token_block;
  } else if (head.chunk_tokens > 0) {
    t.nb = std::min({fitting, tokens, head.chunk_tokens});
  } else {
    t.nb = std::min(fitting, tokens);
  }
  if (head.chunk_tokens > 0) {
    t.chunk = std::max(t.nb, round_down(head.chunk_tokens, t.nb));
  } else {
    t.chunk = std::max(t.nb, round_down(fitting, t.nb));
  }
  return t;
}

// ---- validation -------------------------------------------------------------------------

Status check_same_device(const TensorView* t, const char* name, Device expected) {
  if (t == nullptr) return {};
  if (t->device.type == expected.type && t->device.id == expected.id) return {};
  return {Code::kInvalidArgument, expected_got((std::string(name) + ".device").c_str(),
                                               device_text(expected) + " (hidden's device)", device_text(t->device))};
}

// cuBLAS takes 32-bit sizes and strides.
Status check_cublas_sizes(const HeadArgs& a) {
  const std::pair<int64_t, const char*> sizes[] = {{a.tokens(), "hidden: the number of tokens"},
                                                   {a.hidden_size(), "hidden.shape[-1]"},
                                                   {a.vocab_rows(), "weight.shape[0]"},
                                                   {a.hidden.row_stride, "hidden's row stride"},
                                                   {a.weight.row_stride, "weight's row stride"}};
  for (const auto& [value, name] : sizes) {
    if (value > INT32_MAX) {
      return {Code::kUnsupported, expected_got(name, "at most 2^31 - 1 (cuBLAS's sizes)", std::to_string(value))};
    }
  }
  return {};
}

// Every input of a device call: the CPU's checks (check_head_inputs, which reads no values
// of device tensors), the device of each tensor, that each is memory of it, cuBLAS's limits.
Status check_inputs(const HeadInputs& inputs, const TensorView& targets, const TensorView* weights,
                    const VocabShard& shard, const LossOptions& options, const HeadOptions& head, HeadArgs* out) {
  if (inputs.hidden.device.type != DeviceType::kCUDA) {
    return {Code::kInvalidArgument, expected_got("hidden.device", "cuda", device_text(inputs.hidden.device))};
  }
  if (Status s = check_head_inputs(inputs, targets, weights, shard, options, head, out); !s.ok()) return s;
  const Device d = inputs.hidden.device;
  if (Status s = check_same_device(&inputs.weight, "weight", d); !s.ok()) return s;
  if (Status s = check_same_device(inputs.bias, "bias", d); !s.ok()) return s;
  if (Status s = check_same_device(&targets, "targets", d); !s.ok()) return s;
  if (Status s = check_same_device(weights, "weights", d); !s.ok()) return s;
  if (Status s = check_cublas_sizes(*out); !s.ok()) return s;
  const std::pair<const TensorView*, const char*> views[] = {{&inputs.hidden, "hidden"},
                                                             {&inputs.weight, "weight"},
                                                             {inputs.bias, "bias"},
                                                             {&targets, "targets"},
                                                             {weights, "weights"}};
  for (const auto& [view, name] : views) {
    if (view == nullptr) continue;
    if (Status s = check_device_pointer(*view, name); !s.ok()) return s;
  }
  return {};
}

// A device output tensor: on hidden's device and memory of it.
Status check_output_device(const TensorView* t, const char* name, Device d) {
  if (t == nullptr) return {};
  if (Status s = check_same_device(t, name, d); !s.ok()) return s;
  return check_device_pointer(*t, name);
}

// The gradients asked for (check_head_gradients' rules, on hidden's device), with strides
// that cuBLAS takes.
Status check_gradients(const HeadGradients& gradients, const HeadArgs& a, Device d,
                       const std::vector<NamedRegion>& inputs, HeadGradientArgs* out) {
  HeadGradientArgs g;
  const auto on_device = [d](const TensorView& t, const char* name) { return check_output_device(&t, name, d); };
  if (Status s = check_head_gradients(gradients, a, inputs, on_device, &g); !s.ok()) return s;
  for (const GradientArgs* m : {&g.hidden, &g.weight}) {
    if (m->present() && m->matrix.row_stride > INT32_MAX) {
      return {Code::kUnsupported, expected_got("a gradient's row stride", "at most 2^31 - 1 (cuBLAS's strides)",
                                               std::to_string(m->matrix.row_stride))};
    }
  }
  *out = g;
  return {};
}

// The forward's outputs (float32, one per token; the loss one element for a reduction), on
// the device, overlapping neither each other nor the inputs.
Status check_forward_outputs(const HeadArgs& a, Device d, const LossOptions& options, const TensorView& loss,
                             const TensorView& lse, const ForwardExtras& extras, LossOutputs* out) {
  const std::pair<const TensorView*, const char*> views[] = {
      {&loss, "loss"}, {&lse, "lse"}, {extras.target_is_argmax, "target_is_argmax"}, {extras.entropy, "entropy"}};
  for (const auto& [view, name] : views) {
    if (Status s = check_output_device(view, name, d); !s.ok()) return s;
  }
  return detail::check_forward_outputs(a.tokens(), d, options, loss, lse, extras, input_regions(a), out);
}

// ---- the sweeps ---------------------------------------------------------------------------

// One call's validated operands and constants.
struct Call {
  HeadArgs a;
  Tiles tiles;
  LossParams params;
  int64_t vocab_begin = 0;
  int64_t valid = 0;  // the shard's real classes (the others padding), from its first row
  int64_t width = kStatsWidth;
  cudaStream_t stream = nullptr;
  HeadBuffers* b = nullptr;

  bool extras() const { return width == kStatsWidthWithExtras; }
  Operand hidden_rows(int64_t first) const {
    return {a.hidden.base + first * a.hidden.row_stride * a.hidden.dtype.bytes(), cuda_type(a.hidden.dtype),
            std::max<int64_t>(a.hidden.row_stride, std::max<int64_t>(a.hidden.cols, 1))};
  }
  Operand weight_rows(int64_t first) const {
    return {a.weight.base + first * a.weight.row_stride * a.weight.dtype.bytes(), cuda_type(a.weight.dtype),
            std::max<int64_t>(a.weight.row_stride, std::max<int64_t>(a.weight.cols, 1))};
  }
  TileColumns columns(int64_t j0, int64_t vb) const {
    TileColumns c;
    c.col0 = j0;
    c.cols = vb;
    c.valid = std::clamp<int64_t>(valid - j0, 0, vb);
    if (a.bias.base != nullptr) {
      c.bias = a.bias.base;
      c.bias_stride = a.bias.stride;
      c.dtype = a.bias.dtype;
    }
    return c;
  }
  int64_t panel_width(int64_t j0) const { return std::min(tiles.vb, a.vocab_rows() - j0); }
};

Call make_call(const HeadArgs& a, const Tiles& tiles, const VocabShard& shard, const LossOptions& options,
               int64_t width) {
  Call c;
  c.a = a;
  c.tiles = tiles;
  c.params = loss_params(options, shard.vocab_size);
  c.vocab_begin = shard.vocab_begin;
  c.valid = valid_columns(shard.vocab_begin, a.vocab_rows(), c.params);
  c.width = width;
  c.stream = static_cast<cudaStream_t>(options.stream);
  return c;
}

// z [nb, vb] (row stride vb) <- h[i0, i0 + nb) W[j0, j0 + vb)^T: every tile of every mode.
Status tile_gemm(const Call& c, int64_t i0, int64_t nb, int64_t j0, int64_t vb, float* z) {
  return gemm(c.b->handle, c.stream, false, true, nb, vb, c.a.hidden_size(), c.hidden_rows(i0), c.weight_rows(j0), 0.0f,
              z, vb);
}

// The statistics of tokens [r0, r0 + rows) folded panel by panel into running[0, rows).
// `keep` null: each tile goes through the tile buffer; else tile (i, j) stays in `keep`'s
// panel j ([keep_rows, vb] at keep + keep_rows * j0, row stride vb), for the gradients.
Status fold_rows(const Call& c, int64_t r0, int64_t rows, float* keep, int64_t keep_rows, RunningStats* running) {
  if (Status s = init_running(running, rows, c.stream); !s.ok()) return s;
  const int64_t vr = c.a.vocab_rows();
  for (int64_t j0 = 0; j0 < vr; j0 += c.tiles.vb) {
    const int64_t vb = c.panel_width(j0);
    const TileColumns columns = c.columns(j0, vb);
    for (int64_t i0 = 0; i0 < rows; i0 += c.tiles.nb) {
      const int64_t nb = std::min(c.tiles.nb, rows - i0);
      float* z = keep != nullptr ? keep + keep_rows * j0 + i0 * vb : c.b->as<float>(c.b->tile);
      if (Status s = tile_gemm(c, r0 + i0, nb, j0, vb, z); !s.ok()) return s;
      if (Status s = fold_tile(z, vb, nb, columns, slice(c.a.targets, r0 + i0, nb), c.vocab_begin, c.params, c.extras(),
                               running + i0, c.stream);
          !s.ok()) {
        return s;
      }
    }
  }
  return {};
}

// Where the gradients are summed in fp32 before they are stored: the output itself when it
// is fp32, else an fp32 staging buffer.
struct Target {
  float* p = nullptr;
  int64_t ld = 0;
  bool staged = false;
  bool accumulate = false;  // add into the output's old values
};

// What the gradients of every panel share: the outputs' fp32 targets, the upstream
// gradient (shared for a reduction, else per token), the lse of every token.
struct PanelGradients {
  const HeadGradientArgs* g = nullptr;
  Target hidden, weight;
  const double* upstream = nullptr;  // shared, for a reduction; else grad_loss per token
  TokenVector lse, grad_loss;        // every token's
};

// The gradients of panel j0 of tokens [r0, r0 + rows): dz [rows, vb] (row stride vb) holds
// the panel's logits and becomes their gradient (in place), then its GEMMs and column sums.
// `hidden` is h[r0, r0 + rows) as the GEMM takes it; `first_chunk` starts the sums over
// chunks (always true in the backward, which takes every token at once).
Status panel_gradients(const Call& c, const PanelGradients& pg, int64_t r0, int64_t rows, int64_t j0, float* dz,
                       const Operand& hidden, bool first_chunk) {
  const int64_t vb = c.panel_width(j0);
  const int64_t h = c.a.hidden_size();
  const DataType dtype = c.a.hidden.dtype;
  // bf16: dz's exact split, or with bf16_logit_gradients its one rounding (hi alone).
  const bool split = dtype == kBFloat16;
  void* hi = split ? c.b->hi.p : nullptr;
  void* lo = split && !c.a.bf16_logit_gradients ? c.b->lo.p : nullptr;
  const TokenVector grad_loss = pg.upstream != nullptr ? TokenVector{} : slice(pg.grad_loss, r0, rows);
  if (Status s =
          tile_gradient(dz, vb, rows, c.columns(j0, vb), slice(c.a.targets, r0, rows), slice(c.a.weights, r0, rows),
                        slice(pg.lse, r0, rows), grad_loss, pg.upstream, c.vocab_begin, c.params, hi, lo, c.stream);
      !s.ok()) {
    return s;
  }
  if (pg.g->bias.present()) {
    if (Status s = column_sums(dz, vb, rows, vb, c.b->as<double>(c.b->partial), c.b->as<double>(c.b->bias_sums) + j0,
                               first_chunk, c.stream);
        !s.ok()) {
      return s;
    }
  }
  // The panel's gradient as GEMM operands: fp32, or its two bf16 parts, or its bf16 rounding.
  Operand parts[2] = {{dz, CUDA_R_32F, vb}, {nullptr, CUDA_R_32F, vb}};
  int count = 1;
  if (split) {
    parts[0] = {hi, CUDA_R_16BF, vb};
    parts[1] = {lo, CUDA_R_16BF, vb};
    count = lo != nullptr ? 2 : 1;
  }
  if (pg.g->weight.present()) {
    // grad_weight_j [vb, H] (+)= dz^T [vb, rows] h [rows, H].
    float* out = pg.weight.p + j0 * pg.weight.ld;
    for (int p = 0; p < count; ++p) {
      const float beta = p == 0 && first_chunk && !pg.weight.accumulate ? 0.0f : 1.0f;
      if (Status s = gemm(c.b->handle, c.stream, true, false, vb, h, rows, parts[p], hidden, beta, out, pg.weight.ld);
          !s.ok()) {
        return s;
      }
    }
  }
  if (pg.g->hidden.present()) {
    // grad_hidden [rows, H] (+)= dz [rows, vb] W_j [vb, H], panel after panel.
    Operand weight = c.weight_rows(j0);
    if (dtype == kFloat16) {
      float* wide = c.b->as<float>(c.b->weight32);
      if (Status s = widen(weight.p, dtype, vb, h, weight.ld, wide, h, c.stream); !s.ok()) return s;
      weight = {wide, CUDA_R_32F, std::max<int64_t>(h, 1)};
    }
    float* out = pg.hidden.p + r0 * pg.hidden.ld;
    for (int p = 0; p < count; ++p) {
      const float beta = p == 0 && j0 == 0 && !pg.hidden.accumulate ? 0.0f : 1.0f;
      if (Status s = gemm(c.b->handle, c.stream, false, false, rows, h, vb, parts[p], weight, beta, out, pg.hidden.ld);
          !s.ok()) {
        return s;
      }
    }
  }
  return {};
}

// h[r0, r0 + rows) as the gradient GEMMs take it: as stored, or widened to fp32 (fp16).
Status hidden_operand(const Call& c, const HeadGradientArgs& g, int64_t r0, int64_t rows, Operand* out) {
  *out = c.hidden_rows(r0);
  if (c.a.hidden.dtype != kFloat16 || !g.weight.present()) return {};
  const int64_t h = c.a.hidden_size();
  float* wide = c.b->as<float>(c.b->hidden32);
  if (Status s = widen(out->p, kFloat16, rows, h, out->ld, wide, h, c.stream); !s.ok()) return s;
  *out = {wide, CUDA_R_32F, std::max<int64_t>(h, 1)};
  return {};
}

// The fp32 sums of the gradients wanted: into the outputs (fp32) or staging buffers
// (grown here), for `rows` tokens of grad_hidden.
Status gradient_targets(const Call& c, const HeadGradientArgs& g, int64_t hidden_rows, PanelGradients* pg) {
  const int64_t h = c.a.hidden_size();
  auto target_of = [&](const GradientArgs& ga, Buffer& staging, int64_t rows, Target* t) -> Status {
    if (!ga.present()) return {};
    if (ga.matrix.dtype == kFloat32) {
      *t = Target{reinterpret_cast<float*>(ga.matrix.base),
                  std::max<int64_t>(ga.matrix.row_stride, std::max<int64_t>(h, 1)), false, ga.accumulate};
      return {};
    }
    if (Status s = c.b->grow(staging, static_cast<std::size_t>(rows * h) * sizeof(float)); !s.ok()) return s;
    *t = Target{c.b->as<float>(staging), std::max<int64_t>(h, 1), true, false};
    return {};
  };
  if (Status s = target_of(g.hidden, c.b->grad_hidden32, hidden_rows, &pg->hidden); !s.ok()) return s;
  if (Status s = target_of(g.weight, c.b->grad_weight32, c.a.vocab_rows(), &pg->weight); !s.ok()) return s;
  return {};
}

// Grows what the gradients of panels of `rows` tokens need (besides the logits).
Status grow_gradient_buffers(const Call& c, const HeadGradientArgs& g, int64_t rows) {
  HeadBuffers& b = *c.b;
  const int64_t h = c.a.hidden_size();
  const auto panel = static_cast<std::size_t>(rows * c.tiles.vb);
  if (c.a.hidden.dtype == kBFloat16) {
    if (Status s = b.grow(b.hi, panel * 2); !s.ok()) return s;
    if (!c.a.bf16_logit_gradients) {  // the exact split's second part
      if (Status s = b.grow(b.lo, panel * 2); !s.ok()) return s;
    }
  }
  if (c.a.hidden.dtype == kFloat16) {
    if (g.weight.present()) {
      if (Status s = b.grow(b.hidden32, static_cast<std::size_t>(rows * h) * sizeof(float)); !s.ok()) return s;
    }
    if (g.hidden.present()) {
      if (Status s = b.grow(b.weight32, static_cast<std::size_t>(c.tiles.vb * h) * sizeof(float)); !s.ok()) return s;
    }
  }
  if (g.bias.present()) {
    if (Status s = b.grow(b.bias_sums, static_cast<std::size_t>(std::max<int64_t>(c.a.vocab_rows(), 1)) * 8); !s.ok()) {
      return s;
    }
    if (Status s = b.grow(b.partial, static_cast<std::size_t>(kColumnSegments * c.tiles.vb) * 8); !s.ok()) return s;
  }
  return b.grow(b.upstream, sizeof(double));
}

// After the last panel: staged sums into their outputs, the bias, grad_hidden's zeros when
// there was no panel.
Status finish_gradients(const Call& c, const HeadGradientArgs& g, const PanelGradients& pg) {
  const int64_t h = c.a.hidden_size();
  if (g.hidden.present() && c.a.vocab_rows() == 0 && !pg.hidden.accumulate) {
    if (Status s = zero_matrix(pg.hidden.p, c.a.tokens(), h, pg.hidden.ld, c.stream); !s.ok()) return s;
  }
  if (g.hidden.present() && pg.hidden.staged) {
    if (Status s = store_floats(pg.hidden.p, c.a.tokens(), h, pg.hidden.ld, g.hidden.matrix.base, g.hidden.matrix.dtype,
                                g.hidden.matrix.row_stride, c.stream);
        !s.ok()) {
      return s;
    }
  }
  if (g.weight.present() && pg.weight.staged) {
    if (Status s = store_floats(pg.weight.p, c.a.vocab_rows(), h, pg.weight.ld, g.weight.matrix.base,
                                g.weight.matrix.dtype, g.weight.matrix.row_stride, c.stream);
        !s.ok()) {
      return s;
    }
  }
  if (g.bias.present()) {
    if (Status s = store_doubles(c.b->as<double>(c.b->bias_sums), c.a.vocab_rows(), g.bias.matrix.base,
                                 g.bias.matrix.dtype, g.bias.matrix.row_stride, g.bias.accumulate, c.stream);
        !s.ok()) {
      return s;
    }
  }
  return {};
}

// ---- the forward's protocol -------------------------------------------------------------

// The header of this rank's gathers (the head's block), its message ready for an error the
// device finds.
RankHeader head_header(const Communicator& comm, int64_t n, int64_t width, int64_t hidden, const VocabShard& shard,
                       DataType dtype, const LossOptions& options, bool has_weights, bool chunked, float grad_loss,
                       const Status& local) {
  RankHeader header = make_header(comm.rank(), comm.size(), n, width, shard, dtype, options, has_weights, 0,
                                  head_operation(hidden, chunked, n, grad_loss), local);
  set_device_found_message(header, shard, options);
  return header;
}

struct ForwardCall {
  Communicator* comm = nullptr;
  const VocabShard* shard = nullptr;
  const LossOptions* options = nullptr;
  const HeadOptions* head = nullptr;
  const TensorView* targets = nullptr;  // for a rank with bad arguments: its announced token count
  const ForwardExtras* extras = nullptr;
  Workspace* workspace = nullptr;
  DataType dtype{};         // the operands'
  int64_t hidden_size = 0;  // H as announced
  int device = 0;
};

// A forward's call, as announced even when its arguments are bad (H from hidden's shape).
ForwardCall forward_call(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                         const VocabShard& shard, const LossOptions& options, const HeadOptions& head,
                         const ForwardExtras& extras, Workspace* workspace) {
  ForwardCall f;
  f.comm = &comm;
  f.shard = &shard;
  f.options = &options;
  f.head = &head;
  f.targets = &targets;
  f.extras = &extras;
  f.workspace = workspace;
  f.dtype = inputs.hidden.dtype;
  f.hidden_size = inputs.hidden.ndim >= 1 && inputs.hidden.ndim <= TensorView::kMaxDims
                      ? inputs.hidden.shape[inputs.hidden.ndim - 1]
                      : 0;
  f.device = inputs.hidden.device.id;
  return f;
}

// Grows every buffer of a forward of chunks of `chunk` tokens (the logits of a whole chunk
// kept when `g` is given) and of its gradients.
Status prepare_forward(Call& c, const HeadGradientArgs* g, int64_t chunk, PanelGradients* pg) {
  HeadBuffers& b = *c.b;
  if (Status s = b.grow(b.running, static_cast<std::size_t>(chunk) * sizeof(RunningStats)); !s.ok()) return s;
  const int64_t tile = g != nullptr ? chunk * c.a.vocab_rows() : std::min(c.tiles.nb, chunk) * c.tiles.vb;
  if (Status s = b.grow(b.tile, static_cast<std::size_t>(tile) * sizeof(float)); !s.ok()) return s;
  if (g == nullptr) return {};
  if (Status s = grow_gradient_buffers(c, *g, chunk); !s.ok()) return s;
  pg->g = g;
  pg->upstream = b.as<double>(b.upstream);
  return gradient_targets(c, *g, c.a.tokens(), pg);
}

// The forward of tokens in chunks (all N in one for the recompute mode), each with its one
// gather; with `g`, each chunk's gradients right after its loss (chunked mode, upstream
// gradient `grad_loss` of the reduced loss). `local` is this rank's own argument check: a
// rank whose arguments are bad still joins every gather, with its error in the header.
Status run_forward(const ForwardCall& f, Status local, const HeadArgs& a, const LossOutputs& out,
                   const HeadGradientArgs* g, float grad_loss, int64_t* collectives) {
  Communicator& comm = *f.comm;
  const LossOptions& options = *f.options;
  const bool with_extras = f.extras->target_is_argmax != nullptr || f.extras->entropy != nullptr;
  const int64_t width = with_extras ? kStatsWidthWithExtras : kStatsWidth;
  const int64_t n = local.ok() ? a.tokens() : announced_tokens(*f.targets);
  const int64_t vocab_rows =
      local.ok() ? a.vocab_rows() : std::max<int64_t>(f.shard->vocab_end - f.shard->vocab_begin, 0);
  const Tiles tiles = gpu_tiles(*f.head, n, vocab_rows,
                                g != nullptr ? agreed_vocab_rows(*f.shard, comm.size()) : vocab_rows, g != nullptr);
  const int64_t chunk = g != nullptr ? std::min(tiles.chunk, n) : n;
  const int64_t chunks = chunk > 0 ? (n + chunk - 1) / chunk : 1;
  // Every gather of the call carries a whole chunk's payload (the last one's tail unused).
  const std::size_t payload = payload_bytes(chunk, width);
  const std::size_t stats_bytes = round_up(static_cast<std::size_t>(chunk * width) * sizeof(float));
  const std::size_t merged_bytes = stats_bytes + static_cast<std::size_t>(n) * sizeof(double);
  auto stream = static_cast<cudaStream_t>(options.stream);
  if (collectives != nullptr) *collectives = 0;

  if (local.ok() && f.workspace == nullptr) {
    local = {Code::kInvalidArgument,
             "workspace: expected a Workspace for device tensors (it holds the device buffers and the asynchronous "
             "error), got null"};
  }
  Workspace own;  // only when the caller gave none: that is this rank's error, but it still joins
  Workspace::Buffers* buffers = WorkspaceAccess::buffers(f.workspace != nullptr ? *f.workspace : own);
  CurrentDevice current(f.device);
  if (Status s = current.status(); !s.ok()) return local.ok() ? s : local;
  Call c = make_call(a, tiles, *f.shard, options, width);
  PanelGradients pg;
  // Everything is allocated before the first gather, so that no later step fails alone.
  if (local.ok()) local = begin(&buffers->device_head, f.device, stream, &c.b);
  std::optional<CallScope> head_call;  // (declared after `own`: it marks the end before own's buffers go)
  if (local.ok()) head_call.emplace(c.b->order, stream);
  if (local.ok()) local = prepare_forward(c, g, chunk, &pg);
  if (local.ok() && g != nullptr) pg.lse = out.lse;
  DeviceProtocol protocol;
  if (Status s = device_protocol(&buffers->device, f.device, stream, comm.size(), comm.rank(), payload, merged_bytes,
                                 &protocol);
      !s.ok()) {
    return local.ok() ? s : local;  // without its buffers this rank cannot join: the others wait
  }
  const CallScope protocol_call(*protocol.order, stream);
  auto* header = reinterpret_cast<RankHeader*>(protocol.send);
  auto* error = reinterpret_cast<cuda::DeviceError*>(protocol.error);
  auto* stats = reinterpret_cast<float*>(protocol.send + sizeof(RankHeader));
  auto* terms = reinterpret_cast<double*>(protocol.merged + stats_bytes);
  const RankHeader mine = head_header(comm, n, width, local.ok() ? a.hidden_size() : f.hidden_size, *f.shard, f.dtype,
                                      options, f.extras->weights != nullptr, g != nullptr, grad_loss, local);
  if (Status s = cuda::write_header(mine, header, stream); !s.ok()) return local.ok() ? s : local;
  const bool reduced = options.reduction != Reduction::kNone;
  if (local.ok() && g != nullptr) {
    if (Status s = cuda::shared_upstream(nullptr, grad_loss, a.targets, a.weights, n, c.params,
                                         c.b->as<double>(c.b->upstream), c.stream);
        !s.ok()) {
      return s;
    }
  }
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t r0 = k * chunk;
    const int64_t rows = std::min(chunk, n - r0);
    float* keep = g != nullptr && local.ok() ? c.b->as<float>(c.b->tile) : nullptr;  // the chunk's logits
    if (local.ok()) {
      // The header is written once: a bad target or weight found in any chunk stays in it.
      if (Status s = fold_rows(c, r0, rows, keep, chunk, c.b->as<RunningStats>(c.b->running)); !s.ok()) return s;
      if (Status s =
              finalize_stats(c.b->as<RunningStats>(c.b->running), rows, slice(a.targets, r0, rows),
                             slice(a.weights, r0, rows), c.vocab_begin, c.params, width, stats, width, header, stream);
          !s.ok()) {
        return s;
      }
    }
    const Status gathered = comm.device_all_gather(protocol.send, protocol.recv, payload, stream);
    if (collectives != nullptr) ++*collectives;
    if (!gathered.ok()) return local.ok() ? gathered : local;
    if (Status s = cuda::check_group(protocol.recv, static_cast<int64_t>(payload), comm.size(), error, stream);
        !s.ok()) {
      return local.ok() ? s : local;
    }
    if (!local.ok()) continue;
    LossOutputs o;
    o.loss = reduced ? out.loss : slice(out.loss, r0, rows);
    o.lse = slice(out.lse, r0, rows);
    o.target_is_argmax = slice(out.target_is_argmax, r0, rows);
    o.entropy = slice(out.entropy, r0, rows);
    if (Status s = cuda::merge_and_loss(reinterpret_cast<const float*>(protocol.recv + sizeof(RankHeader)),
                                        static_cast<int64_t>(payload / sizeof(float)), comm.size(), rows, width,
                                        reinterpret_cast<float*>(protocol.merged), slice(a.targets, r0, rows),
                                        slice(a.weights, r0, rows), c.params, o, terms + r0, error, stream);
        !s.ok()) {
      return s;
    }
    if (g == nullptr) continue;
    Operand hidden;
    if (Status s = hidden_operand(c, *g, r0, rows, &hidden); !s.ok()) return s;
    for (int64_t j0 = 0; j0 < a.vocab_rows(); j0 += tiles.vb) {
      if (Status s = panel_gradients(c, pg, r0, rows, j0, keep + chunk * j0, hidden, k == 0); !s.ok()) return s;
    }
  }
  if (!local.ok()) return local;
  if (g == nullptr) return {};
  // The reduced loss over every chunk's terms, as one chunk's merge_and_loss reduces them.
  if (reduced && chunks > 1) {
    if (Status s = cuda::reduce_loss(terms, n, a.targets, a.weights, c.params, reinterpret_cast<float*>(out.loss.base),
                                     error, stream);
        !s.ok()) {
      return s;
    }
  }
  if (Status s = finish_gradients(c, *g, pg); !s.ok()) return s;
  // An error the device found in a later chunk's gather poisons every output, as it would
  // have poisoned them in one gather.
  const std::pair<const TokenVector*, bool> vectors[] = {
      {&out.lse, true}, {&out.target_is_argmax, true}, {&out.entropy, true}, {&out.loss, !reduced}};
  for (const auto& [v, wanted] : vectors) {
    if (!wanted || v->base == nullptr) continue;
    if (Status s = poison(v->base, v->dtype, v->n, 1, v->stride, error, stream); !s.ok()) return s;
  }
  for (const GradientArgs* m : {&g->hidden, &g->weight, &g->bias}) {
    if (!m->present()) continue;
    if (Status s = poison(m->matrix.base, m->matrix.dtype, m->matrix.rows, m->matrix.cols, m->matrix.row_stride, error,
                          stream);
        !s.ok()) {
      return s;
    }
  }
  return {};
}

// The backward: per panel, every token's tiles into the [N, Vb] panel, their gradient, its
// GEMMs. `b` is the call's head buffers.
Status run_backward(Call& c, const HeadGradientArgs& g, const TokenVector& lse, const TokenVector& grad_loss) {
  HeadBuffers& b = *c.b;
  const int64_t n = c.a.tokens();
  if (Status s = b.grow(b.tile, static_cast<std::size_t>(n * c.tiles.vb) * sizeof(float)); !s.ok()) return s;
  if (Status s = grow_gradient_buffers(c, g, n); !s.ok()) return s;
  PanelGradients pg;
  pg.g = &g;
  pg.lse = lse;
  pg.grad_loss = grad_loss;
  if (Status s = gradient_targets(c, g, n, &pg); !s.ok()) return s;
  if (c.params.reduction != Reduction::kNone) {
    pg.upstream = b.as<double>(b.upstream);
    if (Status s = cuda::shared_upstream(reinterpret_cast<const float*>(grad_loss.base), 0.0f, c.a.targets, c.a.weights,
                                         n, c.params, b.as<double>(b.upstream), c.stream);
        !s.ok()) {
      return s;
    }
  }
  Operand hidden;
  if (Status s = hidden_operand(c, g, 0, n, &hidden); !s.ok()) return s;
  float* dz = b.as<float>(b.tile);
  for (int64_t j0 = 0; j0 < c.a.vocab_rows(); j0 += c.tiles.vb) {
    const int64_t vb = c.panel_width(j0);
    for (int64_t i0 = 0; i0 < n; i0 += c.tiles.nb) {
      if (Status s = tile_gemm(c, i0, std::min(c.tiles.nb, n - i0), j0, vb, dz + i0 * vb); !s.ok()) return s;
    }
    if (Status s = panel_gradients(c, pg, 0, n, j0, dz, hidden, true); !s.ok()) return s;
  }
  return finish_gradients(c, g, pg);
}

}  // namespace
}  // namespace head_cuda

using head_cuda::Call;
using head_cuda::ForwardCall;

Status device_linear_cross_entropy_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                           const VocabShard& shard, const LossOptions& options, const HeadOptions& head,
                                           const TensorView& loss, const TensorView& lse, const ForwardExtras& extras,
                                           Workspace* workspace) {
  HeadArgs a;
  LossOutputs out;
  Status local = head_cuda::check_inputs(inputs, targets, extras.weights, shard, options, head, &a);
  if (local.ok()) local = head_cuda::check_forward_outputs(a, inputs.hidden.device, options, loss, lse, extras, &out);
  const ForwardCall f = head_cuda::forward_call(comm, inputs, targets, shard, options, head, extras, workspace);
  return head_cuda::run_forward(f, local, a, out, nullptr, 0.0f, nullptr);
}

Status device_linear_cross_entropy_forward_backward(Communicator& comm, const HeadInputs& inputs,
                                                    const TensorView& targets, const VocabShard& shard,
                                                    const LossOptions& options, const HeadOptions& head,
                                                    float grad_loss, const TensorView& loss, const TensorView& lse,
                                                    const HeadGradients& gradients, const ForwardExtras& extras,
                                                    Workspace* workspace, int64_t* collectives) {
  if (collectives != nullptr) *collectives = 0;
  HeadArgs a;
  LossOutputs out;
  HeadGradientArgs g;
  Status local = head_cuda::check_inputs(inputs, targets, extras.weights, shard, options, head, &a);
  if (local.ok() && options.reduction == Reduction::kNone) {
    local = {Code::kInvalidArgument,
             expected_got("options.reduction",
                          "sum or mean (the chunked mode needs the upstream gradient of one reduced loss)", "none")};
  }
  if (local.ok() && !std::isfinite(grad_loss)) {
    local = {Code::kInvalidArgument, expected_got("grad_loss", "a finite value", std::to_string(grad_loss))};
  }
  if (local.ok()) local = head_cuda::check_forward_outputs(a, inputs.hidden.device, options, loss, lse, extras, &out);
  if (local.ok()) {
    std::vector<NamedRegion> regions = input_regions(a);
    for (const auto& [v, name] :
         {std::pair{&out.loss, "loss"}, std::pair{&out.lse, "lse"},
          std::pair{&out.target_is_argmax, "target_is_argmax"}, std::pair{&out.entropy, "entropy"}}) {
      regions.push_back(region_of(name, *v));
    }
    local = head_cuda::check_gradients(gradients, a, inputs.hidden.device, regions, &g);
  }
  const ForwardCall f = head_cuda::forward_call(comm, inputs, targets, shard, options, head, extras, workspace);
  return head_cuda::run_forward(f, local, a, out, &g, grad_loss, collectives);
}

Status device_linear_cross_entropy_backward(const HeadInputs& inputs, const TensorView& targets, const TensorView& lse,
                                            const TensorView& grad_loss, const VocabShard& shard,
                                            const LossOptions& options, const HeadOptions& head,
                                            const HeadGradients& gradients, const TensorView* weights,
                                            Workspace* workspace) {
  HeadArgs a;
  if (Status s = head_cuda::check_inputs(inputs, targets, weights, shard, options, head, &a); !s.ok()) return s;
  const Device d = inputs.hidden.device;
  for (const auto& [view, name] : {std::pair{&lse, "lse"}, std::pair{&grad_loss, "grad_loss"}}) {
    if (Status s = head_cuda::check_output_device(view, name, d); !s.ok()) return s;
  }
  TokenVector lse_in, upstream;
  if (Status s = as_lse_tokens(lse, "lse", a.tokens(), &lse_in); !s.ok()) return s;
  if (Status s = check_loss_output(grad_loss, "grad_loss", a.tokens(), options.reduction, &upstream); !s.ok()) return s;
  std::vector<NamedRegion> regions = input_regions(a);
  regions.push_back(region_of("lse", lse_in));
  regions.push_back(region_of("grad_loss", upstream));
  HeadGradientArgs g;
  if (Status s = head_cuda::check_gradients(gradients, a, d, regions, &g); !s.ok()) return s;
  if (!g.hidden.present() && !g.weight.present() && !g.bias.present()) return {};
  // Without a workspace the buffers and the cuBLAS handle are this call's, and it waits for
  // its stream before it returns them.
  std::shared_ptr<void> own;
  std::shared_ptr<void>* state = workspace != nullptr ? &WorkspaceAccess::buffers(*workspace)->device_head : &own;
  CurrentDevice current(d.id);
  if (Status s = current.status(); !s.ok()) return s;
  const head_cuda::Tiles tiles = head_cuda::gpu_tiles(head, a.tokens(), a.vocab_rows(), a.vocab_rows(), false);
  Call c = head_cuda::make_call(a, tiles, shard, options, kStatsWidth);
  if (Status s = head_cuda::begin(state, d.id, c.stream, &c.b); !s.ok()) return s;
  const CallScope call(c.b->order, c.stream);  // (after `own`: marks the end before own's buffers go)
  return head_cuda::run_backward(c, g, lse_in, upstream);
}

Status device_linear_cross_entropy_local_stats(const HeadInputs& inputs, const TensorView& targets,
                                               const VocabShard& shard, const LossOptions& options,
                                               const HeadOptions& head, const TensorView& stats) {
  HeadArgs a;
  if (Status s = head_cuda::check_inputs(inputs, targets, nullptr, shard, options, head, &a); !s.ok()) return s;
  const Device d = inputs.hidden.device;
  if (Status s = head_cuda::check_output_device(&stats, "stats", d); !s.ok()) return s;
  if (stats.ndim != 2) {
    return {Code::kInvalidArgument, expected_got("stats.ndim", "2 ([tokens, 4 or 6])", std::to_string(stats.ndim))};
  }
  const int64_t width = stats.shape[1] == kStatsWidthWithExtras ? kStatsWidthWithExtras : kStatsWidth;
  RowMatrix out;
  if (Status s = as_stats_matrix(stats, "stats", a.tokens(), width, &out); !s.ok()) return s;
  if (Status s = check_no_overlap({{"stats", out.begin_byte(), out.end_byte()}}, input_regions(a)); !s.ok()) return s;
  // No workspace here: the buffers and the cuBLAS handle are this call's, and it waits for
  // its stream before it returns them.
  std::shared_ptr<void> own;
  CurrentDevice current(d.id);
  if (Status s = current.status(); !s.ok()) return s;
  const head_cuda::Tiles tiles = head_cuda::gpu_tiles(head, a.tokens(), a.vocab_rows(), a.vocab_rows(), false);
  Call c = head_cuda::make_call(a, tiles, shard, options, width);
  if (Status s = head_cuda::begin(&own, d.id, c.stream, &c.b); !s.ok()) return s;
  const CallScope call(c.b->order, c.stream);  // (after `own`: marks the end before own's buffers go)
  head_cuda::HeadBuffers& b = *c.b;
  const int64_t n = a.tokens();
  if (Status s = b.grow(b.running, static_cast<std::size_t>(n) * sizeof(head_cuda::RunningStats)); !s.ok()) return s;
  if (Status s = b.grow(b.tile, static_cast<std::size_t>(std::min(tiles.nb, n) * tiles.vb) * sizeof(float)); !s.ok()) {
    return s;
  }
  auto* running = b.as<head_cuda::RunningStats>(b.running);
  if (Status s = head_cuda::fold_rows(c, 0, n, nullptr, n, running); !s.ok()) return s;
  return head_cuda::finalize_stats(running, n, a.targets, a.weights, c.vocab_begin, c.params, width,
                                   reinterpret_cast<float*>(out.base), out.row_stride, nullptr, c.stream);
}

}  // namespace vpce::detail
