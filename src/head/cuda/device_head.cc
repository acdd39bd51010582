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
#include "device_buffers.h"
#include "device_checks.h"
#include "device_sweeps.h"
#include "head_kernels.h"

namespace vpce::detail {
namespace head_cuda {
namespace {

// ---- the forward's protocol -------------------------------------------------------------

// The header of this rank's gathers (the head's block), its message ready for an error the
// device finds.
RankHeader head_header(const Communicator& comm, int64_t n, int64_t width, int64_t hidden, const VocabShard& shard,
                       DataType dtype, const LossOptions& options, bool has_weights, bool chunked, float grad_loss,
                       bool round_logits, const Status& local) {
  RankHeader header = make_header(comm.rank(), comm.size(), n, width, shard, dtype, options, has_weights, 0,
                                  head_operation(hidden, chunked, n, grad_loss, round_logits), local);
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
  const PolicyForward* policy = nullptr;  // the RL outputs' forward, in the loss's place
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
  const int64_t width = f.policy != nullptr || with_extras ? kStatsWidthWithExtras : kStatsWidth;
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
  WorkspaceLease lease(f.workspace);  // (none given, or held: this rank's error; it still joins)
  if (local.ok()) local = lease.status();
  Workspace::Buffers* buffers = lease.buffers();
  CurrentDevice current(f.device);
  if (Status s = current.status(); !s.ok()) return local.ok() ? s : local;
  Call c = make_call(a, tiles, *f.shard, options, width);
  if (f.policy != nullptr) c.params = f.policy->params;
  PanelGradients pg;
  // Everything is allocated before the first gather, so that no later step fails alone.
  if (local.ok()) local = begin(&buffers->device_head, f.device, stream, &c.b);
  std::optional<CallScope> head_call;  // (declared after the lease: it marks the end before the lease's buffers go)
  if (local.ok()) head_call.emplace(c.b->order, stream);
  if (local.ok()) local = prepare_forward(c, g, chunk, &pg);
  // The RL outputs' chunked mode keeps every token's lse and E_p[z] in fp64 for the gradients.
  TokenVector kept_lse, kept_mean;
  PolicyBackwardInputs policy_upstream;
  if (local.ok() && g != nullptr && f.policy != nullptr) {
    local = c.b->grow(c.b->kept, static_cast<std::size_t>(2 * n) * sizeof(double));
    kept_lse = TokenVector{c.b->kept.p, kFloat64, n, 1};
    kept_mean = TokenVector{c.b->kept.p + n * static_cast<int64_t>(sizeof(double)), kFloat64, n, 1};
    policy_upstream = {true, f.policy->upstream.grad_log_prob, f.policy->upstream.grad_entropy, kept_mean};
    pg.upstream = nullptr;
    pg.policy = &policy_upstream;
  }
  if (local.ok() && g != nullptr) pg.lse = f.policy != nullptr ? kept_lse : out.lse;
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
  RankHeader mine;
  if (f.policy != nullptr) {
    mine = make_header(comm.rank(), comm.size(), n, width, *f.shard, f.dtype, options, false, 0, f.policy->operation,
                       local);
    set_device_found_message(mine, f.policy->found_message);
  } else {
    mine = head_header(comm, n, width, local.ok() ? a.hidden_size() : f.hidden_size, *f.shard, f.dtype, options,
                       f.extras->weights != nullptr, g != nullptr, grad_loss, a.round_logits, local);
  }
  if (Status s = cuda::write_header(mine, header, stream); !s.ok()) return local.ok() ? s : local;
  const bool reduced = options.reduction != Reduction::kNone;
  if (local.ok() && g != nullptr && f.policy == nullptr) {
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
      if (Status s = finalize_stats(c.b->as<RunningStats>(c.b->running), rows, slice(a.targets, r0, rows),
                                    slice(a.weights, r0, rows), c.vocab_begin, c.params_at(r0), width, stats, width,
                                    header, stream);
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
    if (f.policy != nullptr) {
      // The chunk's outputs, and in the chunked mode the kept lse and E_p[z] of its tokens.
      const PolicyForwardOutputs& u = f.policy->out;
      const PolicyForwardOutputs chunk_out[2] = {
          {true,
           slice(u.log_prob, r0, rows),
           slice(u.entropy, r0, rows),
           slice(u.lse, r0, rows),
           slice(u.mean_logit, r0, rows),
           {}},
          {true, {}, {}, slice(kept_lse, r0, rows), slice(kept_mean, r0, rows), {}}};
      for (int part = 0; part < (g != nullptr ? 2 : 1); ++part) {
        if (Status s = cuda::merge_and_policy(reinterpret_cast<const float*>(protocol.recv + sizeof(RankHeader)),
                                              static_cast<int64_t>(payload / sizeof(float)), comm.size(), rows, width,
                                              reinterpret_cast<float*>(protocol.merged), slice(a.targets, r0, rows),
                                              c.params_at(r0), chunk_out[part], error, stream);
            !s.ok()) {
          return s;
        }
      }
    } else {
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
  const PolicyForwardOutputs& u = f.policy != nullptr ? f.policy->out : PolicyForwardOutputs{};
  const std::pair<const TokenVector*, bool> vectors[] = {{&out.lse, true},     {&out.target_is_argmax, true},
                                                         {&out.entropy, true}, {&out.loss, !reduced},
                                                         {&u.log_prob, true},  {&u.entropy, true},
                                                         {&u.lse, true},       {&u.mean_logit, true}};
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

// The recompute backward of validated arguments on device d: the buffers (the workspace's,
// refused while another call holds it, or, where none is given, this call's, which then waits
// for its stream before it returns them), then run_backward.
Status recompute_backward(const HeadArgs& a, const HeadOptions& head, const VocabShard& shard,
                          const LossOptions& options, const LossParams& params, const HeadGradientArgs& g,
                          const TokenVector& lse, const TokenVector& grad_loss, const PolicyBackwardInputs* policy,
                          Device d, Workspace* workspace) {
  if (!g.hidden.present() && !g.weight.present() && !g.bias.present()) return {};
  WorkspaceLease lease(workspace);
  if (Status s = lease.status(); !s.ok()) return s;
  std::shared_ptr<void>* state = &lease.buffers()->device_head;
  CurrentDevice current(d.id);
  if (Status s = current.status(); !s.ok()) return s;
  const Tiles tiles = gpu_tiles(head, a.tokens(), a.vocab_rows(), a.vocab_rows(), false);
  Call c = make_call(a, tiles, shard, options, kStatsWidth);
  c.params = params;
  if (Status s = begin(state, d.id, c.stream, &c.b); !s.ok()) return s;
  const CallScope call(c.b->order, c.stream);  // (after the lease: marks the end before its buffers go)
  return run_backward(c, g, lse, grad_loss, policy);
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
  return head_cuda::recompute_backward(a, head, shard, options, loss_params(options, shard), g, lse_in, upstream,
                                       nullptr, d, workspace);
}

Status device_policy_linear_forward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                    const VocabShard& shard, const LossOptions& options, const HeadOptions& head,
                                    const PreparePolicy& prepare, Workspace* workspace) {
  HeadArgs a;
  Status local = head_cuda::check_inputs(inputs, targets, nullptr, shard, options, head, &a);
  PolicyForward policy;
  local = prepare(local, a, &policy);
  const ForwardExtras none;
  ForwardCall f = head_cuda::forward_call(comm, inputs, targets, shard, options, head, none, workspace);
  f.policy = &policy;
  return head_cuda::run_forward(f, local, a, LossOutputs{}, nullptr, 0.0f, nullptr);
}

Status device_policy_linear_forward_backward(Communicator& comm, const HeadInputs& inputs, const TensorView& targets,
                                             const VocabShard& shard, const LossOptions& options,
                                             const HeadOptions& head, const HeadGradients& gradients,
                                             const PreparePolicy& prepare, Workspace* workspace, int64_t* collectives) {
  if (collectives != nullptr) *collectives = 0;
  HeadArgs a;
  Status local = head_cuda::check_inputs(inputs, targets, nullptr, shard, options, head, &a);
  PolicyForward policy;
  local = prepare(local, a, &policy);
  HeadGradientArgs g;
  if (local.ok()) {
    std::vector<NamedRegion> regions = input_regions(a);
    regions.insert(regions.end(), policy.regions.begin(), policy.regions.end());
    local = head_cuda::check_gradients(gradients, a, inputs.hidden.device, regions, &g);
  }
  const ForwardExtras none;
  ForwardCall f = head_cuda::forward_call(comm, inputs, targets, shard, options, head, none, workspace);
  f.policy = &policy;
  return head_cuda::run_forward(f, local, a, LossOutputs{}, &g, 0.0f, collectives);
}

Status device_policy_linear_backward(const HeadInputs& inputs, const TensorView& targets, const VocabShard& shard,
                                     const LossOptions& options, const HeadOptions& head,
                                     const HeadGradients& gradients, const CheckPolicyBackward& check,
                                     Workspace* workspace) {
  HeadArgs a;
  if (Status s = head_cuda::check_inputs(inputs, targets, nullptr, shard, options, head, &a); !s.ok()) return s;
  const Device d = inputs.hidden.device;
  TokenVector lse;
  PolicyBackwardInputs policy;
  LossParams params;
  std::vector<NamedRegion> regions = input_regions(a);
  if (Status s = check(a, &lse, &policy, &params, &regions); !s.ok()) return s;
  HeadGradientArgs g;
  if (Status s = head_cuda::check_gradients(gradients, a, d, regions, &g); !s.ok()) return s;
  return head_cuda::recompute_backward(a, head, shard, options, params, g, lse, TokenVector{}, &policy, d, workspace);
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
