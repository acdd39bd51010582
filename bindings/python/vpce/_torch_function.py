"""The loss as a torch.autograd.Function: the forward (every check, vpce's forward with its
one collective, any error agreed across the group) and the backward (no collective, the
gradient in place or a new tensor): vocab_parallel_cross_entropy's path on PyTorch < 2.4,
for the eager in-place gradient and for arguments the custom op does not take; and
Megatron's _VocabParallelCrossEntropy."""
from __future__ import annotations

import torch
import torch.utils.dlpack
import torch.distributed as dist

from . import _vpce
from ._torch_arguments import (_as_rows, _as_targets, _check_inplace, _check_logits, _first_derivative_only,
                               _options)
from ._torch_collective import _calling, _Collective
from ._torch_groups import _group
from ._torch_legacy import _legacy_options


def _increment_version(tensor):
    """Tells autograd that `tensor` was written in place, as PyTorch's in-place ops do, so
    that any backward that saved it (a second one through this graph, or another op's)
    raises instead of reading the gradient as if it were the logits."""
    increment = getattr(torch.autograd.graph, "increment_version", None)  # PyTorch >= 2.1
    if increment is not None:
        increment(tensor)
    else:  # an in-place op on an empty view: bumps the shared version counter, writes nothing
        tensor.detach().narrow(-1, 0, 0).zero_()


def _function_forward(ctx, logits, target, label_smoothing, tp_group, inplace_backward, legacy_smoothing, options):
    """The autograd.Function forward (both classes): the group, then _forward with its one
    collective, any error agreed across the group."""

    def body(collective, rank, size):
        return _forward(ctx, collective, rank, size, logits, target, label_smoothing, inplace_backward,
                        legacy_smoothing, options)

    return _with_group(tp_group, logits, body)


def _with_group(tp_group, logits, body):
    """body(collective, rank, size) on the group (collective None for one rank): the one
    gather of a forward on logits (the loss's, the RL outputs'), any error agreed across the
    group."""
    group, rank, size = _group(tp_group)
    if (size > 1 and isinstance(logits, torch.Tensor) and logits.device.type == "cpu"
            and dist.get_backend(group) == "nccl"):
        raise ValueError("tp_group: expected a process group that can gather CPU tensors (gloo), got NCCL "
                         "with CPU logits")
    with _calling(group, size) as call:
        collective = _Collective(call, rank, size) if call is not None else None
        try:
            return body(collective, rank, size)
        except Exception as error:
            agreed = error if collective is None else collective.agreed(error)
            if agreed is error:
                raise
            raise agreed from error


def _function_backward(ctx, grad_loss):
    x, y, lse = ctx.saved_tensors
    g = grad_loss.to(torch.float32).contiguous()
    grad = _gradient(x, y, lse, g, ctx.shard, ctx.smoothing, ctx.options, ctx.inplace)
    if ctx.inplace:
        _increment_version(x)
    if ctx.input_dtype != grad.dtype:
        grad = grad.to(ctx.input_dtype)
    return grad


def _gradient(x, y, lse, g, shard, smoothing, options, inplace):
    """The gradient of vpce's forward (no collective): over x when in place, else new."""
    opts = _options(smoothing, options)
    grad = x if inplace else _new_gradient(x)
    _vpce.backward(x, y, lse, g, *shard, opts, grad)
    return grad


class _VpceCrossEntropy(torch.autograd.Function):
    """vocab_parallel_cross_entropy with vpce's options (the path on PyTorch < 2.4, and for
    the in-place gradient, which overwrites a tensor autograd saved)."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, tp_group, inplace_backward, legacy_smoothing, options):
        return _function_forward(ctx, logits, target, label_smoothing, tp_group, inplace_backward, legacy_smoothing,
                                 options)

    @staticmethod
    def backward(ctx, grad_loss):
        _first_derivative_only("vocab_parallel_cross_entropy")
        return _function_backward(ctx, grad_loss), None, None, None, None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's autograd function, with its signature: apply(vocab_parallel_logits, target,
    label_smoothing=0.0, tp_group=None). vpce's exact loss and gradient (label smoothing
    exact across ranks; see vocab_parallel_cross_entropy for the options), a new gradient."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        """Vocab parallel cross entropy forward function."""
        return _function_forward(ctx, vocab_parallel_logits, target, label_smoothing, tp_group, False, False, {})

    @staticmethod
    def backward(ctx, grad_output):
        """Vocab parallel cross entropy backward function."""
        _first_derivative_only("vocab_parallel_cross_entropy")
        return _function_backward(ctx, grad_output), None, None, None


def _forward(ctx, collective, rank, size, logits, target, label_smoothing, inplace, legacy, options):
    """The autograd forward: every check, then vpce's forward (its one collective through
    `collective`, None for one rank). Any error raised here reaches the other ranks."""
    loss, x, y, lse, shard, options = _loss(collective, rank, size, logits, target, label_smoothing, inplace, legacy,
                                            options)
    ctx.save_for_backward(x, y, lse)
    ctx.shard, ctx.smoothing, ctx.options = shard, label_smoothing, options  # plain values, not bound objects
    ctx.inplace = inplace
    ctx.input_dtype = logits.dtype
    return loss


def _loss(collective, rank, size, logits, target, label_smoothing, inplace, legacy, options):
    """Checks, then vpce's forward: (loss, x read, y read, lse, shard, the options as the
    backward takes them)."""
    _check_logits(logits)
    if isinstance(target, torch.Tensor) and tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target.shape: expected the logits' leading shape {tuple(logits.shape[:-1])} (one target "
                         f"per token, as Megatron), got {tuple(target.shape)}")
    y = _as_targets(target, logits)
    if legacy:
        options = _legacy_options(label_smoothing, options)
    if inplace:
        _check_inplace(logits)
    opts = _options(label_smoothing, options)
    x = _as_rows(logits)
    local = x.shape[-1]
    shard = (rank * local, (rank + 1) * local, size * local)
    loss = torch.empty(target.shape, dtype=torch.float32, device=x.device)
    # float64: the backward's gradient keeps fp32's accuracy up to |lse| ~ 1e9
    lse = torch.empty(target.shape, dtype=torch.float64, device=x.device)
    if collective is not None:
        collective.agree("megatron_legacy_label_smoothing", legacy)
    _vpce.forward(x, y, *shard, opts, loss, lse, rank=rank, size=size, all_gather=collective)
    loss = loss.double() if logits.dtype == torch.float64 else loss
    return loss, x, y, lse, shard, options


_HUGE_PAGE = 2 << 20  # bytes


def _new_gradient(x):
    """A new contiguous tensor like x for the gradient. A CPU one of 2 MiB or more is a
    mapping of its own on 2 MiB boundaries, advised onto transparent huge pages before the
    kernel first writes it, and reused for the next gradient of its size once freed
    (_vpce.gradient_buffer: not glibc's heap, whose holes a gradient per step kept resident,
    and no page faults every step)."""
    nbytes = x.numel() * x.element_size()
    if x.device.type != "cpu" or nbytes < _HUGE_PAGE:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    buffer = torch.utils.dlpack.from_dlpack(_vpce.gradient_buffer(nbytes))
    return buffer.view(x.dtype).view(x.shape)
