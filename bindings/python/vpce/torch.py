"""vpce.torch: vpce as a drop-in for Megatron-LM's vocab-parallel cross-entropy.

    from vpce.torch import vocab_parallel_cross_entropy
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing, tp_group=group)

Same signature, shapes and return value as
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``: logits ``[s, b, V/R]`` on
each of the R ranks of ``tp_group`` (rank r holds columns ``[r V/R, (r+1) V/R)``), targets
``[s, b]`` of global class ids, the per-token loss ``[s, b]`` in float32 returned on every
rank. The forward makes one all-gather on ``tp_group`` (16 bytes per token plus a 256-byte
header per rank) instead of Megatron's three all-reduces; the backward makes none, and
only the per-token lse (4 bytes per token) is kept between them, not a softmax of the
logits' size. Label smoothing is exact across ranks (Megatron's uses the shard's size and
mean, so its loss differs between ranks); ``megatron_legacy_label_smoothing=True``
reproduces Megatron's values for anyone who needs parity with a past run.

CPU tensors with a gloo (or any CPU-capable) process group; GPU tensors arrive with vpce's
CUDA build.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _vpce

__all__ = ["vocab_parallel_cross_entropy", "unfused_cross_entropy"]

_SEMANTICS = {"megatron": _vpce.SmoothingSemantics.MEGATRON, "pytorch": _vpce.SmoothingSemantics.PYTORCH}
_OPTION_NAMES = ("ignore_index", "z_loss_weight", "logit_scale", "softcap", "valid_vocab_size",
                 "smoothing_semantics", "num_threads")


def _megatron_tp_group():
    """Megatron's current tensor-parallel group, when Megatron is there and initialised."""
    try:
        from megatron.core import parallel_state  # noqa: PLC0415 (optional dependency)
    except ImportError:
        return None
    try:
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_group()
    except (AssertionError, RuntimeError):
        return None
    return None


def _group(tp_group):
    """(group, rank, size); a missing group or torch.distributed means one rank."""
    if tp_group is None:
        tp_group = _megatron_tp_group()
    if tp_group is None or not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    return tp_group, dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _all_gather(group, size):
    """The forward's one collective on `group`, into the buffer vpce hands us."""
    def gather(send, recv):
        source = torch.frombuffer(send, dtype=torch.uint8)
        destination = torch.frombuffer(recv, dtype=torch.uint8)
        dist.all_gather(list(destination.view(size, -1).unbind(0)), source, group=group)
    return gather


def _options(label_smoothing, options):
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"vocab_parallel_cross_entropy: unexpected options {unknown}; expected some of {list(_OPTION_NAMES)}")
    result = _vpce.LossOptions()
    result.label_smoothing = float(label_smoothing)
    for name, value in options.items():
        if name == "smoothing_semantics":
            if value not in _SEMANTICS:
                raise ValueError(f"smoothing_semantics: expected 'megatron' or 'pytorch', got {value!r}")
            value = _SEMANTICS[value]
        setattr(result, name, value)
    return result


def _as_rows(logits):
    """The logits as vpce reads them: a contiguous last dimension and leading dimensions that
    collapse to one row stride (Megatron's [s, b, V/R], contiguous or sliced); else a copy."""
    if logits.dim() == 0:
        return logits
    if logits.dtype == torch.float64:  # vpce's math is fp32 for every dtype
        logits = logits.float()
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        return logits.contiguous()
    dims = [(n, s) for n, s in zip(logits.shape[:-1], logits.stride()[:-1]) if n != 1]
    for (_, outer), (inner_n, inner_s) in zip(dims, dims[1:]):
        if outer != inner_s * inner_n:
            return logits.contiguous()
    return logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, tp_group, inplace_backward, legacy_smoothing, options):
        group, rank, size = _group(tp_group)
        if size > 1 and logits.device.type == "cpu" and dist.get_backend(group) == "nccl":
            raise ValueError("tp_group: expected a process group that can gather CPU tensors (gloo), got NCCL "
                             "with CPU logits")
        x = _as_rows(logits)
        y = target if target.dtype in (torch.int32, torch.int64) else target.long()
        local = x.shape[-1]
        shard = (rank * local, (rank + 1) * local, size * local)
        smoothing = 0.0 if legacy_smoothing else label_smoothing
        opts = _options(smoothing, options)
        loss = torch.empty(target.shape, dtype=torch.float32, device=x.device)
        lse = torch.empty(target.shape, dtype=torch.float32, device=x.device)
        _vpce.forward(x, y, *shard, opts, loss, lse, rank=rank, size=size,
                      all_gather=_all_gather(group, size) if size > 1 else None)
        if legacy_smoothing and label_smoothing > 0:
            loss = _legacy_loss(x, lse, loss, label_smoothing)
        ctx.save_for_backward(x, y, lse)
        ctx.shard, ctx.smoothing, ctx.options = shard, smoothing, options  # plain values, not bound objects
        ctx.inplace = inplace_backward
        ctx.legacy_smoothing = label_smoothing if legacy_smoothing else 0.0
        ctx.input_dtype = logits.dtype
        return loss.double() if logits.dtype == torch.float64 else loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, y, lse = ctx.saved_tensors
        g = grad_loss.to(torch.float32).contiguous()
        opts = _options(ctx.smoothing, ctx.options)
        if ctx.legacy_smoothing:
            grad = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            _vpce.backward(x, y, lse, g, *ctx.shard, opts, grad)
            _legacy_grad(grad, y, g, ctx.shard, ctx.legacy_smoothing)
            grad = grad.to(x.dtype)
        else:
            grad = x if ctx.inplace else _new_gradient(x)
            _vpce.backward(x, y, lse, g, *ctx.shard, opts, grad)
        if ctx.input_dtype != grad.dtype:
            grad = grad.to(ctx.input_dtype)
        return grad, None, None, None, None, None, None


_HUGE_PAGES_FROM = 64 << 20  # bytes


def _new_gradient(x):
    """A new tensor like x for the gradient. A large CPU one is advised onto transparent
    huge pages before the kernel first writes it: PyTorch's CPU allocator hands out fresh
    pages on every call, and faulting them in 4 KiB at a time costs more than the backward
    itself (docs/performance.md)."""
    grad = torch.empty_like(x)
    nbytes = grad.numel() * grad.element_size()
    if grad.device.type == "cpu" and grad.is_contiguous() and nbytes >= _HUGE_PAGES_FROM:
        _vpce.advise_huge_pages(grad.data_ptr(), nbytes)
    return grad


def _legacy_loss(x, lse, loss, alpha):
    """Megatron's loss with label smoothing: the shard's size K and the shard's mean
    log-probability, (1 - s) loss - s mean_v(z_v - lse) with s = alpha K / (K - 1)."""
    k = x.shape[-1]
    s = alpha * k / (k - 1)
    mean_log_probs = x.float().mean(dim=-1) - lse
    return (1.0 - s) * loss - s * mean_log_probs


def _legacy_grad(grad, y, g, shard, alpha):
    """Megatron's gradient with label smoothing: g (p - (1 - s) onehot - s / K), from vpce's
    g (p - onehot) (without smoothing), in place on the float32 `grad`."""
    begin, end, _ = shard
    k = end - begin
    s = alpha * k / (k - 1)
    rows = grad.view(-1, k)
    flat_g = g.reshape(-1)
    rows.sub_((flat_g * (s / k)).unsqueeze(-1))
    flat_y = y.reshape(-1).long()
    owned = (flat_y >= begin) & (flat_y < end)
    index = torch.nonzero(owned).squeeze(-1)
    rows[index, flat_y[index] - begin] += flat_g[index] * s


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None, *,
                                 inplace_backward=False, megatron_legacy_label_smoothing=False, **options):
    """Per-token cross-entropy of logits split over the vocabulary across `tp_group`.

    vocab_parallel_logits: [s, b, V/R] (any leading shape), float32, bfloat16 or float16
        (float64 is computed in float32, as every dtype is); rank r holds columns
        [r V/R, (r+1) V/R).
    target: [s, b] global class ids (int64 or int32).
    label_smoothing: in [0, 1); Megatron's meaning (target 1 - a, every other class
        a / (V - 1)) over the global vocabulary; smoothing_semantics="pytorch" for
        F.cross_entropy's.
    tp_group: the tensor-parallel process group; None means Megatron's current group when
        Megatron is initialised, else a single rank.
    inplace_backward: write the gradient over the logits (as Megatron does) instead of a
        new tensor; only when nothing else needs the logits afterwards.
    megatron_legacy_label_smoothing: reproduce Megatron's smoothed values (shard size and
        shard mean, different on every rank) for parity with a past run.
    options: ignore_index (-100), z_loss_weight, logit_scale, softcap, valid_vocab_size,
        smoothing_semantics ("megatron" or "pytorch"), num_threads.

    Returns the float32 loss with target's shape, the same on every rank.
    """
    if megatron_legacy_label_smoothing and options:
        raise ValueError("megatron_legacy_label_smoothing: expected no other options (it reproduces Megatron's plain "
                         f"loss), got {sorted(options)}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group,
                                            inplace_backward, megatron_legacy_label_smoothing, options)


def unfused_cross_entropy(logits, labels, tp_group=None):
    """Megatron's unfused_cross_entropy: vocab_parallel_cross_entropy without smoothing."""
    return vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group)
