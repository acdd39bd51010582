// head/cuda/device_sweeps.h: the fused head's sweeps over tiles on the device: the tiles'
// sizes, one call's operands and constants, the statistics folded panel by panel, and each
// panel's gradients (head_kernels.cu's epilogues between cuBLAS GEMMs); the backward.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../head_args.h"
#include "device_buffers.h"
#include "head_kernels.h"

namespace vpce::detail::head_cuda {

// The GPU's default tiles (HeadOptions fields left 0): an fp32 tile or panel of at most
// kBudget floats (256 MiB).
inline constexpr int64_t kBudget = int64_t{64} << 20;

inline constexpr int64_t kMaxDefaultVocabBlock = 4096;

inline constexpr int64_t kMinDefaultVocabBlock = 256;

struct Tiles;
struct Call;
struct Target;
struct PanelGradients;

// value rounded down to a multiple of `multiple`.
int64_t round_down(int64_t value, int64_t multiple);

// The GPU's tiles: the values given (the chunk rounded down to a multiple of Nb), else tiles
// of up to kBudget fp32 elements: Vb from N (the backward's [N, Vb] panel, at most V_r); in
// the recompute mode Nb from Vb (a [Nb, Vb] tile: few, large GEMMs), the same in its forward
// and backward for the same N, V_r and options; in the chunked mode Nb and the chunk from
// `budget_rows` = ceil(V / R) vocabulary rows (a [chunk, budget_rows] block), which every
// rank agrees on, so that its gathers have the same sizes on uneven ranges too. (Where the
// two modes' tiles differ, cuBLAS may pick other kernels, and the last bits of their logits
// may differ.)
Tiles gpu_tiles(const HeadOptions& head, int64_t n, int64_t vocab_rows, int64_t budget_rows, bool chunked);

Call make_call(const HeadArgs& a, const Tiles& tiles, const VocabShard& shard, const LossOptions& options,
               int64_t width);

// z [nb, vb] (row stride vb) <- h[i0, i0 + nb) W[j0, j0 + vb)^T: every tile of every mode.
Status tile_gemm(const Call& c, int64_t i0, int64_t nb, int64_t j0, int64_t vb, float* z);

// The statistics of tokens [r0, r0 + rows) folded panel by panel into running[0, rows).
// `keep` null: each tile goes through the tile buffer; else tile (i, j) stays in `keep`'s
// panel j ([keep_rows, vb] at keep + keep_rows * j0, row stride vb), for the gradients.
Status fold_rows(const Call& c, int64_t r0, int64_t rows, float* keep, int64_t keep_rows, RunningStats* running);

// The gradients of panel j0 of tokens [r0, r0 + rows): dz [rows, vb] (row stride vb) holds
// the panel's logits and becomes their gradient (in place), then its GEMMs and column sums.
// `hidden` is h[r0, r0 + rows) as the GEMM takes it; `first_chunk` starts the sums over
// chunks (always true in the backward, which takes every token at once).
Status panel_gradients(const Call& c, const PanelGradients& pg, int64_t r0, int64_t rows, int64_t j0, float* dz,
                       const Operand& hidden, bool first_chunk);

// h[r0, r0 + rows) as the gradient GEMMs take it: as stored, or widened to fp32 (fp16).
Status hidden_operand(const Call& c, const HeadGradientArgs& g, int64_t r0, int64_t rows, Operand* out);

// The fp32 sums of the gradients wanted: into the outputs (fp32) or staging buffers
// (grown here), for `rows` tokens of grad_hidden.
Status gradient_targets(const Call& c, const HeadGradientArgs& g, int64_t hidden_rows, PanelGradients* pg);

// Grows what the gradients of panels of `rows` tokens need (besides the logits).
Status grow_gradient_buffers(const Call& c, const HeadGradientArgs& g, int64_t rows);

// After the last panel: staged sums into their outputs, the bias, grad_hidden's zeros when
// there was no panel.
Status finish_gradients(const Call& c, const HeadGradientArgs& g, const PanelGradients& pg);

// The backward: per panel, every token's tiles into the [N, Vb] panel, their gradient, its
// GEMMs. `b` is the call's head buffers. With `policy`, the RL outputs' gradient (grad_loss
// unused).
Status run_backward(Call& c, const HeadGradientArgs& g, const TokenVector& lse, const TokenVector& grad_loss,
                    const PolicyBackwardInputs* policy = nullptr);

struct Tiles {
  int64_t nb = 1;     // tokens per tile
  int64_t vb = 1;     // vocabulary rows per panel
  int64_t chunk = 1;  // tokens per chunk (chunked mode), a multiple of nb
};

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
  // The parameters of the tokens from `first` on (the RL outputs' per-token temperatures
  // start there).
  LossParams params_at(int64_t first) const {
    LossParams p = params;
    if (p.temperatures != nullptr) p.temperatures += first * p.temperature_stride;
    return p;
  }
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
    if (a.round_logits) c.rounding = a.hidden.dtype;
    return c;
  }
  int64_t panel_width(int64_t j0) const { return std::min(tiles.vb, a.vocab_rows() - j0); }
};

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
  // The RL outputs' upstream gradients and E_p[z], every token's (grad_loss then unused).
  const PolicyBackwardInputs* policy = nullptr;
};

}  // namespace vpce::detail::head_cuda
