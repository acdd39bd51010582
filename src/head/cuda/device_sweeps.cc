// head/cuda/device_sweeps.cc: the fused head's device sweeps (device_sweeps.h).
#include "device_sweeps.h"

#include <algorithm>

namespace vpce::detail::head_cuda {

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

Call make_call(const HeadArgs& a, const Tiles& tiles, const VocabShard& shard, const LossOptions& options,
               int64_t width) {
  Call c;
  c.a = a;
  c.tiles = tiles;
  c.params = loss_params(options, shard);
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
      if (Status s = fold_tile(z, vb, nb, columns, slice(c.a.targets, r0 + i0, nb), c.vocab_begin, c.params_at(r0 + i0),
                               c.extras(), running + i0, c.stream);
          !s.ok()) {
        return s;
      }
    }
  }
  return {};
}

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
  PolicyBackwardInputs policy;
  if (pg.policy != nullptr) {
    policy = {true, slice(pg.policy->grad_log_prob, r0, rows), slice(pg.policy->grad_entropy, r0, rows),
              slice(pg.policy->mean_logit, r0, rows)};
  }
  if (Status s =
          tile_gradient(dz, vb, rows, c.columns(j0, vb), slice(c.a.targets, r0, rows), slice(c.a.weights, r0, rows),
                        slice(pg.lse, r0, rows), grad_loss, pg.upstream, c.vocab_begin, c.params_at(r0), hi, lo,
                        c.stream, pg.policy != nullptr ? &policy : nullptr);
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

// The backward: per panel, every token's tiles into the [N, Vb] panel, their gradient, its
// GEMMs. `b` is the call's head buffers.
Status run_backward(Call& c, const HeadGradientArgs& g, const TokenVector& lse, const TokenVector& grad_loss,
                    const PolicyBackwardInputs* policy) {
  HeadBuffers& b = *c.b;
  const int64_t n = c.a.tokens();
  if (Status s = b.grow(b.tile, static_cast<std::size_t>(n * c.tiles.vb) * sizeof(float)); !s.ok()) return s;
  if (Status s = grow_gradient_buffers(c, g, n); !s.ok()) return s;
  PanelGradients pg;
  pg.g = &g;
  pg.lse = lse;
  pg.grad_loss = grad_loss;
  pg.policy = policy;
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

}  // namespace vpce::detail::head_cuda
