"""The fused head, vpce.torch.linear_cross_entropy: Megatron's output layer (a
ColumnParallelLinear whose rank holds a slice of the vocabulary's rows of the weight) and
vpce's loss in one autograd step, on vpce's C++ head (vpce/head.h), which never builds the
logits. This module has the public function, its arguments, the collectives around the
head (the sequence-parallel all-gather of the hidden states, the all-reduce or
reduce-scatter of their gradient), the torch.autograd.Function path and the custom ops
(PyTorch >= 2.4; the group key and options' JSON of _torch_ops), both on the same
forward and backward functions.

Two modes:
  - "recompute" (the default): the forward keeps the lse (float64, 8 bytes per token) and the
    inputs; the backward recomputes the logit tiles for the gradients. Collectives: the
    loss's one all-gather in the forward; the hidden gradient's all-reduce (or, with
    sequence parallelism, the hidden states' all-gather again and the gradient's
    reduce-scatter, as Megatron's layer does) in the backward.
  - "chunked" (reduction "sum" or "mean"): the forward also computes the gradients, for
    an upstream gradient of 1, into fresh buffers (fp32), and makes every collective; the
    backward only multiplies them by the upstream gradient (no GEMM, no collective). In
    eager mode (the autograd.Function) the buffers are scaled in place: one backward per
    forward. Under torch.compile (the custom op) the backward scales a copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _vpce
from ._torch_arguments import (_GRADIENT_DTYPES, _LOGITS_DTYPES, _LSE_DTYPES, _OPTION_NAMES, _TARGET_DTYPES,
                               _WIDENED_TARGET_DTYPES, _as_float32, _as_rows, _as_targets, _check_float_tensor,
                               _check_op_tensors, _first_derivative_only, _options, _real, _reverse_mode_only)
from ._torch_collective import _BLOCK_HEADER, _HIDDEN_GRADIENT, _HIDDEN_STATES, _calling, _Collective
from ._torch_compile import _CUSTOM_OPS, _compiling
from ._torch_groups import _group
from ._torch_legacy import _legacy_options
from ._torch_ops import _decode_options, _encode_options, _group_key, _keyed_group

_HEAD_OPTION_NAMES = ("token_block", "vocab_block", "chunk_tokens", "bf16_logit_gradients", "round_logits")
_OWN_OPTION_NAMES = ("mode", "reduction", "gradient_accumulation_fusion", "vocab_range")
_MODES = ("recompute", "chunked")
_REDUCTIONS = {"none": _vpce.Reduction.NONE, "sum": _vpce.Reduction.SUM, "mean": _vpce.Reduction.MEAN}
_OPERAND_DTYPES = _LOGITS_DTYPES  # the head's hidden, weight and bias


# ---- arguments ------------------------------------------------------------------------------

class _Arguments:
    """linear_cross_entropy's options, checked: the loss's (vpce.LossOptions, with the
    reduction), the head's (vpce.HeadOptions), the mode, the weight gradient's
    accumulation, the vocabulary range. Plain values only, so that it can be rebuilt from
    the JSON of the custom ops."""

    def __init__(self, label_smoothing, options):
        names = set(_OPTION_NAMES) | set(_HEAD_OPTION_NAMES) | set(_OWN_OPTION_NAMES)
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"linear_cross_entropy: unexpected options {unknown}; expected some of "
                            f"{sorted(names)}")
        self.label_smoothing = _real(label_smoothing, "label_smoothing")
        self.loss_options = {k: v for k, v in options.items() if k in _OPTION_NAMES}
        self.head_options = {k: v for k, v in options.items() if k in _HEAD_OPTION_NAMES}
        self.mode = options.get("mode", "recompute")
        if self.mode not in _MODES:
            raise ValueError(f"mode: expected 'recompute' or 'chunked', got {self.mode!r}")
        self.reduction = options.get("reduction", "none")
        if not (isinstance(self.reduction, str) and self.reduction in _REDUCTIONS):
            raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {self.reduction!r}")
        if self.mode == "chunked" and self.reduction == "none":
            raise ValueError("mode: expected 'recompute' for reduction 'none' (the chunked mode needs the upstream "
                             "gradient at forward time: reduction 'sum' or 'mean'), got 'chunked'")
        self.accumulate_main_grad = options.get("gradient_accumulation_fusion", False)
        if not isinstance(self.accumulate_main_grad, bool):
            raise TypeError("gradient_accumulation_fusion: expected a bool, got "
                            f"{type(self.accumulate_main_grad).__name__} {self.accumulate_main_grad!r}")
        self.vocab_range = options.get("vocab_range")
        if self.vocab_range is not None:
            ok = (isinstance(self.vocab_range, (tuple, list)) and len(self.vocab_range) == 3
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in self.vocab_range))
            if not ok:
                raise TypeError("vocab_range: expected (vocab_begin, vocab_end, vocab_size), three integers, got "
                                f"{self.vocab_range!r}")
            self.vocab_range = tuple(self.vocab_range)
        self.loss = _options(self.label_smoothing, self.loss_options)  # checks every loss option's value
        self.loss.reduction = _REDUCTIONS[self.reduction]
        self.head = _vpce.HeadOptions()
        for name, value in self.head_options.items():
            setattr(self.head, name, value)

    def shard(self, rows, rank, size):
        """(vocab_begin, vocab_end, vocab_size): vocab_range as given (uneven slices), else
        Megatron's equal slices of `rows` rows each."""
        if self.vocab_range is not None:
            return self.vocab_range
        return rank * rows, (rank + 1) * rows, size * rows


def _autocast_enabled(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # PyTorch before 2.4 takes no device type
        return torch.is_autocast_enabled() or (device_type == "cpu" and torch.is_autocast_cpu_enabled())


def _check_operands(hidden, weight, bias, target, sequence_parallel, size):
    if not isinstance(sequence_parallel, bool):  # ("no" would be true)
        kind = type(sequence_parallel)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"sequence_parallel: expected a bool, got {name} {sequence_parallel!r}")
    _check_float_tensor("hidden", hidden, dims=(1, 8) if not sequence_parallel else (2, 8))
    _check_float_tensor("weight", weight, dims=(2, 2))
    for name, other in (("weight", weight), ("bias", bias)):
        if other is None:
            continue
        _check_float_tensor(name, other)
        if other.dtype != hidden.dtype:
            hint = (" (torch.autocast does not cast for vpce: pass the operands in one dtype)"
                    if _autocast_enabled(hidden.device.type) else "")
            raise TypeError(f"{name}.dtype: expected hidden's dtype {hidden.dtype}, got {other.dtype}{hint}")
        if other.device != hidden.device:
            raise ValueError(f"{name}.device: expected hidden's device {hidden.device}, got {other.device}")
    if bias is not None and bias.dim() != 1:
        raise ValueError(f"bias.dim(): expected 1 ([V/R]), got {bias.dim()}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor, got {type(target).__name__}")
    if target.device != hidden.device:
        raise ValueError(f"target.device: expected hidden's device {hidden.device}, got {target.device}")
    tokens = tuple(hidden.shape[:-1])
    if sequence_parallel:  # hidden is this rank's slice of the sequence (dim 0)
        tokens = (tokens[0] * size, *tokens[1:])
    if tuple(target.shape) != tokens:
        what = "the gathered sequence's leading shape" if sequence_parallel else "hidden's leading shape"
        raise ValueError(f"target.shape: expected {what} {tokens} (one target per token, as Megatron), got "
                         f"{tuple(target.shape)}")


def _operand(tensor, name):
    """A tensor as the C++ head reads it (float64 computed in float32, rows of one stride)."""
    if tensor is None:
        return None
    if tensor.dim() == 1:
        return _as_float32(tensor, name) if tensor.dtype == torch.float64 else tensor
    return _as_rows(tensor, name)


def _present(bias):
    """The bias as the C++ head takes it: None for an empty one (an empty slice of the
    vocabulary), whose data pointer is null and which the head takes for no bias; its
    gradient is then empty, nothing to compute."""
    return None if bias is None or bias.numel() == 0 else bias


def _check_group(group, size, hidden):
    if size > 1 and hidden.device.type == "cpu" and dist.get_backend(group) == "nccl":
        raise ValueError("tp_group: expected a process group that can gather CPU tensors (gloo), got NCCL "
                         "with CPU tensors")


def _agreed(error, collectives):
    """The error every rank raises for `error`, from the first of the forward's collectives
    that this rank has not completed (see _torch_collective._Collective.agreed)."""
    for collective in collectives:
        if collective is None:
            continue
        if not collective.joined or collective.error is not None:
            return collective.agreed(error)
    last = next((c for c in reversed(collectives) if c is not None), None)
    return error if last is None else last.agreed(error)


# ---- the sequence-parallel gather of the hidden states ----------------------------------

class _HiddenGather(_Collective):
    """The sequence-parallel all-gather of the hidden states along dim 0, in blocks as the
    loss's gather (a header, so that a rank that failed before it still joins it with its
    error, and ranks in different gathers learn it, and every rank raises that error)."""

    kind = _HIDDEN_STATES

    def gather(self, hidden):
        """Every rank's hidden [s_r, ...] concatenated along dim 0 (rank 0's first)."""
        local = hidden.contiguous()
        payload = local.view(-1).view(torch.uint8) if local.numel() else torch.empty(0, dtype=torch.uint8)
        sizes, blocks = self._gather(0, payload)
        if self.error is not None:
            raise self.error
        if len(set(sizes)) != 1:
            self.error = _vpce.Error("invalid usage: ranks disagree on the size of the sequence-parallel hidden "
                                     f"states: {list(sizes)} bytes on ranks 0 to {self.size - 1}")
            raise self.error
        header = _BLOCK_HEADER.size
        gathered = blocks[:, header:header + sizes[0]].contiguous().view(-1)
        gathered = gathered.view(local.dtype) if local.numel() else torch.empty(0, dtype=local.dtype)
        return gathered.view(self.size * local.shape[0], *local.shape[1:])


def _forward_collectives(call, rank, size, sequence_parallel, need_hidden):
    """(the hidden states' gather or None, the loss's gather), both None on one rank, each
    agreeing on sequence_parallel (which decides whether the first is made) and on whether
    the backward will reduce hidden's gradient (which decides its collective)."""
    if call is None:
        return None, None
    gather = _HiddenGather(call, rank, size) if sequence_parallel else None
    collective = _Collective(call, rank, size)
    for c in (gather, collective):
        if c is not None:
            c.agree("sequence_parallel", sequence_parallel is True)
            c.agree(_HIDDEN_GRADIENT, need_hidden)
    return gather, collective


def _all_gather_hidden(hidden, group, size):
    """The backward's all-gather of the hidden states (the forward agreed on them already)."""
    local = hidden.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=0)


_REDUCE_SCATTER = {}  # backend name -> whether dist.reduce_scatter_tensor works on it


def _reduce_scatter(full, group, rank, size):
    """This rank's slice along dim 0 of the group's sum of `full` (float32): one
    reduce-scatter, or an all-reduce and the slice where the backend has none (gloo
    before PyTorch 2.x)."""
    rows = full.shape[0] // size
    backend = str(dist.get_backend(group))
    if _REDUCE_SCATTER.get(backend, hasattr(dist, "reduce_scatter_tensor")):
        out = torch.empty((rows, *full.shape[1:]), dtype=full.dtype, device=full.device)
        try:
            dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
            _REDUCE_SCATTER[backend] = True
            return out
        except RuntimeError as error:  # unsupported: every rank fails alike, before any communication
            if "support" not in str(error):
                raise
            _REDUCE_SCATTER[backend] = False
    dist.all_reduce(full, group=group)
    return full.narrow(0, rank * rows, rows).clone()


def _reduce_hidden_gradient(grad, group, rank, size, sequence_parallel):
    """The hidden states' gradient from this rank's part (float32): the group's sum
    (all-reduce), or with sequence parallelism this rank's tokens of it (reduce-scatter)."""
    if size == 1:
        return grad
    if sequence_parallel:
        return _reduce_scatter(grad, group, rank, size)
    dist.all_reduce(grad, group=group)
    return grad


# ---- the weight gradient into main_grad (Megatron's gradient-accumulation fusion) ------------

def _main_grad(weight, args):
    """weight.main_grad when the gradient is to be added into it (gradient_accumulation_fusion
    and a main_grad of the weight's shape), else None."""
    if not args.accumulate_main_grad:
        return None
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return None
    if not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape:
        raise ValueError(f"weight.main_grad: expected a tensor of the weight's shape {tuple(weight.shape)}, got "
                         f"{getattr(main_grad, 'shape', type(main_grad).__name__)}")
    if not main_grad.is_floating_point() or main_grad.device != weight.device:
        raise TypeError(f"weight.main_grad: expected a floating-point tensor on {weight.device}, got "
                        f"{main_grad.dtype} on {main_grad.device}")
    return main_grad


def _returned_weight_gradient(weight, main_grad, dtype):
    """What the backward returns for the weight once its gradient went into main_grad, as
    Megatron's LinearWithGradAccumulationAndAsyncCommunication does: with
    weight.grad_added_to_main_grad (overlapped gradient reduction) a dummy tensor, zeros if
    weight.zero_out_wgrad, and the flag set; else None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    if getattr(weight, "zero_out_wgrad", False):
        dummy = torch.zeros(main_grad.shape, dtype=dtype, device=main_grad.device)
    else:
        dummy = torch.empty(main_grad.shape, dtype=dtype, device=main_grad.device)
    weight.grad_added_to_main_grad = True
    return dummy


# ---- the forward and backward, shared by the autograd.Function and the custom ops ----------

def _output_shapes(target, args):
    return (tuple(target.shape) if args.reduction == "none" else ()), tuple(target.shape)


def _forward_operands(group, rank, size, gather, hidden, weight, bias, target, label_smoothing, options,
                      sequence_parallel, need_weight):
    """A forward's checked operands: (args, targets, the hidden states (all the group's with
    sequence parallelism, through `gather`), weight, bias, shard). need_weight: weight.main_grad,
    which the gradients go into, is checked too, before any gather, so that a bad one fails
    every rank alike."""
    _check_group(group, size, hidden)
    _check_operands(hidden, weight, bias, target, sequence_parallel, size)
    args = _Arguments(label_smoothing, options)
    if need_weight:
        _main_grad(weight, args)
    y = _as_targets(target, hidden)
    h = _operand(hidden, "hidden")
    total = gather.gather(h) if gather is not None else h
    w, b = _operand(weight, "weight"), _operand(bias, "bias")
    return args, y, total, w, b, args.shard(w.shape[0], rank, size)


def _head_forward(hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel, options,
                  need_hidden, need_weight=False):
    """The recompute forward: (loss, lse, shard), every collective's errors agreed across
    the group, and whether the backward will reduce hidden's gradient (need_hidden).
    `options` the keyword options (dict). need_weight: weight.main_grad, which the backward
    adds into, is checked here, where a bad one fails every rank alike (in the backward one
    rank's error would leave the others in the hidden gradient's all-reduce)."""

    def kernel(args, y, total, w, b, shard, collective, rank, size):
        loss_shape, lse_shape = _output_shapes(target, args)
        loss = torch.empty(loss_shape, dtype=torch.float32, device=total.device)
        # float64: the backward's gradient keeps fp32's accuracy up to |lse| ~ 1e9
        lse = torch.empty(lse_shape, dtype=torch.float64, device=total.device)
        _vpce.linear_cross_entropy_forward(total, w, _present(b), y, *shard, args.loss, args.head, loss, lse,
                                           rank=rank, size=size, all_gather=collective)
        return loss, lse

    (loss, lse), shard = _head_forward_with(kernel, hidden, weight, bias, target, label_smoothing, tp_group,
                                            sequence_parallel, options, need_hidden, need_weight)
    if hidden.dtype == torch.float64:
        loss = loss.double()
    return loss, lse, shard


def _head_forward_with(kernel, hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel, options,
                       need_hidden, need_weight, check=None):
    """A recompute forward's scaffolding, for any operation of the head: the group, the
    operation's own argument check (check(), when given), the sequence-parallel gather, the
    checked operands, then kernel(args, targets, all hidden states, weight, bias, shard,
    collective, rank, size) -> its outputs; every error agreed across the group. Returns
    (outputs, shard)."""
    group, rank, size = _group(tp_group)
    with _calling(group, size) as call:
        gather, collective = _forward_collectives(call, rank, size, sequence_parallel, need_hidden)
        try:
            if check is not None:
                check()
            args, y, total, w, b, shard = _forward_operands(
                group, rank, size, gather, hidden, weight, bias, target, label_smoothing, options, sequence_parallel,
                need_weight)
            outputs = kernel(args, y, total, w, b, shard, collective, rank, size)
        except Exception as error:
            agreed = _agreed(error, (gather, collective))
            if agreed is error:
                raise
            raise agreed from error
    return outputs, shard


def _head_backward(hidden, weight, bias, target, lse, grad_loss, label_smoothing, tp_group, sequence_parallel,
                   options, needs):
    """The recompute backward: (grad_hidden, grad_weight, grad_bias), each None where
    needs[i] is false; the weight's None too when it went into weight.main_grad."""

    def kernel(args, y, total, w, b, shard, grad_hidden, grad_weight, grad_bias, add_weight):
        g = grad_loss.to(torch.float32).contiguous()
        _vpce.linear_cross_entropy_backward(total, w, _present(b), y, lse, g, *shard, args.loss, args.head, grad_hidden,
                                            grad_weight, None if _present(b) is None else grad_bias,
                                            accumulate_weight=add_weight)

    return _head_backward_with(kernel, hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel,
                               options, needs)


def _head_backward_with(kernel, hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel, options,
                        needs):
    """A recompute backward's scaffolding, for any operation of the head: the operands (the
    group's hidden states gathered with sequence parallelism), the gradients' buffers, then
    kernel(args, targets, hidden states, weight, bias, shard, grad_hidden, grad_weight,
    grad_bias, add_weight), then the hidden gradient's reduction, main_grad and the dtypes:
    (grad_hidden, grad_weight, grad_bias), each None where needs[i] is false."""
    group, rank, size = _group(tp_group)
    with _calling(group, size):  # one call at a time on the group in this process
        args = _Arguments(label_smoothing, options)
        y = _as_targets(target, hidden)
        h = _operand(hidden, "hidden")
        total = _all_gather_hidden(h, group, size) if size > 1 and sequence_parallel else h
        w, b = _operand(weight, "weight"), _operand(bias, "bias")
        shard = args.shard(w.shape[0], rank, size)
        need_hidden, need_weight, need_bias = needs
        need_bias = need_bias and bias is not None
        # The hidden part is summed over the group in fp32; on one rank it is written in the
        # operand's dtype directly.
        grad_hidden = None
        if need_hidden:
            dtype = torch.float32 if size > 1 else total.dtype
            grad_hidden = torch.empty(total.shape, dtype=dtype, device=total.device)
        main_grad = _main_grad(weight, args) if need_weight else None
        add_weight = main_grad is not None and main_grad.dtype == torch.float32 and main_grad.is_contiguous()
        grad_weight = None
        if need_weight:
            grad_weight = main_grad if add_weight else torch.empty(w.shape, dtype=torch.float32 if main_grad is not None
                                                                    else w.dtype, device=w.device)
        grad_bias = torch.empty(b.shape, dtype=b.dtype, device=b.device) if need_bias else None
        kernel(args, y, total, w, b, shard, grad_hidden, grad_weight, grad_bias, add_weight)
        if grad_hidden is not None:
            grad_hidden = _reduce_hidden_gradient(grad_hidden, group, rank, size, sequence_parallel)
            grad_hidden = grad_hidden.to(hidden.dtype).view(hidden.shape)
        if main_grad is not None:
            if not add_weight:  # an fp16/bf16 (or strided) main_grad: added by torch
                main_grad.add_(grad_weight.to(main_grad.dtype))
            grad_weight = _returned_weight_gradient(weight, main_grad, hidden.dtype)
        elif grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias


def _head_chunked(hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel, options, needs):
    """The chunked forward: (loss, grad_hidden, grad_weight, grad_bias) for an upstream
    gradient of 1, the gradients float32 (None where not needed), the hidden one already
    summed over the group (or reduce-scattered); every collective made here."""

    def kernel(args, y, total, w, b, shard, grad_hidden, grad_weight, grad_bias, collective, rank, size):
        loss = torch.empty((), dtype=torch.float32, device=total.device)
        lse = torch.empty(tuple(target.shape), dtype=torch.float64, device=total.device)
        _vpce.linear_cross_entropy_forward_backward(total, w, _present(b), y, *shard, args.loss, args.head, 1.0, loss,
                                                    lse, grad_hidden, grad_weight, grad_bias, rank=rank, size=size,
                                                    all_gather=collective)
        return loss.double() if hidden.dtype == torch.float64 else loss

    loss, grads = _head_chunked_with(kernel, hidden, weight, bias, target, label_smoothing, tp_group,
                                     sequence_parallel, options, needs)
    return (loss, *grads)


def _head_chunked_with(kernel, hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel, options,
                       needs, check=None):
    """A chunked forward's scaffolding, for any operation of the head: the group, the
    operation's own argument check (check(), when given), the sequence-parallel gather, the
    checked operands, float32 gradients (None where needs[i] is false), then kernel(args,
    targets, all hidden states, weight, bias, shard, grad_hidden, grad_weight, grad_bias or
    None for an empty slice, collective, rank, size) -> its outputs; then the hidden gradient
    summed over the group (or reduce-scattered); every error agreed across the group. Returns
    (outputs, (grad_hidden, grad_weight, grad_bias))."""
    group, rank, size = _group(tp_group)
    with _calling(group, size) as call:
        gather, collective = _forward_collectives(call, rank, size, sequence_parallel, needs[0])
        try:
            if check is not None:
                check()
            need_hidden, need_weight, need_bias = needs
            args, y, total, w, b, shard = _forward_operands(
                group, rank, size, gather, hidden, weight, bias, target, label_smoothing, options, sequence_parallel,
                need_weight)
            device = total.device
            grad_hidden = torch.empty(total.shape, dtype=torch.float32, device=device) if need_hidden else None
            grad_weight = torch.empty(w.shape, dtype=torch.float32, device=device) if need_weight else None
            grad_bias = (torch.empty(b.shape, dtype=torch.float32, device=device)
                         if need_bias and bias is not None else None)
            if grad_bias is not None:
                grad_bias.zero_()  # stays zero for an empty slice, which the head is given as no bias
            outputs = kernel(args, y, total, w, b, shard, grad_hidden, grad_weight,
                             None if _present(b) is None else grad_bias, collective, rank, size)
        except Exception as error:
            agreed = _agreed(error, (gather, collective))
            if agreed is error:
                raise
            raise agreed from error
        if grad_hidden is not None:
            grad_hidden = _reduce_hidden_gradient(grad_hidden, group, rank, size, sequence_parallel).view(hidden.shape)
        return outputs, (grad_hidden, grad_weight, grad_bias)


def _scaled(gradient, grad_loss, dtype):
    """A chunked-mode gradient (float32, upstream 1) times the upstream gradient, in place,
    then in dtype."""
    if gradient is None:
        return None
    g = grad_loss.reshape(()).to(torch.float32)
    return gradient.mul_(g).to(dtype)


def _keep_chunked(ctx, gradients, hidden, weight, bias, needs):
    """Keeps a chunked forward's gradients (upstream 1) on ctx for _chunked_backward."""
    ctx.gradients = list(gradients)
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.has_bias = bias is not None
    # weight.main_grad is looked up in the backward, as the recompute mode does (it may be
    # attached after the forward); the forward checked the one it had.
    ctx.weight = weight if needs[1] else None


def _chunked_backward(ctx, grad_output, arguments, call, instead):
    """The gradients _keep_chunked kept, times the scalar upstream gradient, in the operands'
    dtypes, the weight's added into main_grad where it has one: (grad_hidden, grad_weight,
    grad_bias). Once per forward (the first backward consumes them)."""
    if ctx.gradients is None:
        raise RuntimeError(f"{call}: expected one backward per forward (the gradients computed in the forward were "
                           f"consumed by the first); {instead}")
    grad_hidden, grad_weight, grad_bias = ctx.gradients
    ctx.gradients = None
    hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
    grad_hidden = _scaled(grad_hidden, grad_output, hidden_dtype)
    main_grad = None if ctx.weight is None else _main_grad(ctx.weight, arguments)
    if main_grad is not None and grad_weight is not None:
        main_grad.add_(_scaled(grad_weight, grad_output, torch.float32).to(main_grad.dtype))
        grad_weight = _returned_weight_gradient(ctx.weight, main_grad, hidden_dtype)
    else:
        grad_weight = _scaled(grad_weight, grad_output, weight_dtype)
    grad_bias = _scaled(grad_bias, grad_output, bias_dtype) if ctx.has_bias else None
    return grad_hidden, grad_weight, grad_bias


# ---- the autograd.Function ----------------------------------------------------------------


class _LinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy as a torch.autograd.Function: the path on PyTorch < 2.4, with
    gradient_accumulation_fusion (main_grad is not an argument of the custom ops), and for
    arguments the custom ops do not take (whose checks then raise)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel, options):
        needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        ctx.arguments = (label_smoothing, tp_group, sequence_parallel, options)
        if options.get("mode", "recompute") == "chunked":
            loss, grad_hidden, grad_weight, grad_bias = _head_chunked(hidden, weight, bias, target, label_smoothing,
                                                                      tp_group, sequence_parallel, options, needs)
            ctx.chunked = True
            _keep_chunked(ctx, (grad_hidden, grad_weight, grad_bias), hidden, weight, bias, needs)
            return loss
        loss, lse, _ = _head_forward(hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel,
                                     options, needs[0], needs[1])
        ctx.chunked = False
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        _first_derivative_only("linear_cross_entropy")
        if ctx.chunked:
            label_smoothing, _, _, options = ctx.arguments
            grads = _chunked_backward(ctx, grad_loss, _Arguments(label_smoothing, options),
                                      "linear_cross_entropy (mode 'chunked')",
                                      "use mode 'recompute' to backward more than once")
            return (*grads, None, None, None, None, None)
        hidden, weight, bias, target, lse = ctx.saved_tensors
        needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        label_smoothing, tp_group, sequence_parallel, options = ctx.arguments
        grads = _head_backward(hidden, weight, bias, target, lse, grad_loss, label_smoothing, tp_group,
                               sequence_parallel, options, needs)
        return (*grads, None, None, None, None, None)


# ---- the custom ops (PyTorch >= 2.4) ---------------------------------------------------------
# vpce::linear_cross_entropy_forward / _backward (recompute) and vpce::linear_cross_entropy_
# chunked, with fake implementations and registered autograd, so that torch.compile(fullgraph=
# True) traces the head with no graph break. The group is an integer key and the options JSON,
# as for the loss's ops (_torch_ops).

def _needs(*tensors):
    return tuple(t is not None and torch.is_grad_enabled() and t.requires_grad for t in tensors)


def _nothing(like):
    return like.new_empty(0)


def _check_head_op(op, hidden, weight, bias, target, lse=None, grad_loss=None, real=True):
    _check_op_tensors(f"vpce::{op}", "hidden", hidden,
                      (("hidden", hidden, _OPERAND_DTYPES), ("weight", weight, (hidden.dtype,)),
                       ("bias", bias, (hidden.dtype,)), ("target", target, _TARGET_DTYPES + _WIDENED_TARGET_DTYPES),
                       ("lse", lse, _LSE_DTYPES), ("grad_loss", grad_loss, _GRADIENT_DTYPES)), real)


def _register_chunked_autograd(op, name, first_gradient, first_need):
    """The autograd of a chunked custom op whose first output is a scalar and whose outputs
    [first_gradient, first_gradient + 3) are the gradients of hidden, weight and bias for an
    upstream gradient of 1 (inputs [first_need, first_need + 3) say which are needed; hidden,
    weight and bias are its first three inputs). The backward scales them out of place (the
    op's outputs are not to be changed); eager calls take the autograd.Functions, which
    scale them in place."""

    def setup(ctx, inputs, output):
        hidden, weight, bias = inputs[:3]
        ctx.save_for_backward(*output[first_gradient:first_gradient + 3])
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.needs = inputs[first_need:first_need + 3]
        ctx.inputs = len(inputs)

    def backward(ctx, grad_output, *unused):
        del unused  # the other outputs are not differentiated through
        _first_derivative_only(name)
        g = grad_output.reshape(()).to(torch.float32)
        grads = [(gradient * g).to(dtype) if need else None
                 for gradient, dtype, need in zip(ctx.saved_tensors, ctx.dtypes, ctx.needs)]
        return (*grads, *([None] * (ctx.inputs - 3)))

    torch.library.register_autograd(op, backward, setup_context=setup)


if _CUSTOM_OPS:
    from typing import Optional, Tuple  # noqa: E402

    from torch import Tensor  # noqa: E402

    @torch.library.custom_op("vpce::linear_cross_entropy_forward", mutates_args=())
    def _op_head_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                         label_smoothing: float, group_key: int, sequence_parallel: bool,
                         options: str, need_hidden: bool) -> Tuple[Tensor, Tensor]:
        """The head's recompute forward: (loss, lse); the loss's one all-gather (and the
        sequence-parallel one of the hidden states) on the keyed group, which also agrees on
        need_hidden (whether the backward reduces hidden's gradient)."""
        _check_head_op("linear_cross_entropy_forward", hidden, weight, bias, target)
        loss, lse, _ = _head_forward(hidden, weight, bias, target, label_smoothing, _keyed_group(group_key),
                                     sequence_parallel, _decode_options(options), need_hidden)
        return loss, lse

    def _fake_loss(hidden, target, options):
        reduction = _decode_options(options).get("reduction", "none")
        shape = tuple(target.shape) if reduction == "none" else ()
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        return hidden.new_empty(shape, dtype=dtype)

    @_op_head_forward.register_fake
    def _(hidden, weight, bias, target, label_smoothing, group_key, sequence_parallel, options, need_hidden):
        _check_head_op("linear_cross_entropy_forward", hidden, weight, bias, target, real=False)
        return _fake_loss(hidden, target, options), hidden.new_empty(tuple(target.shape), dtype=torch.float64)

    @torch.library.custom_op("vpce::linear_cross_entropy_backward", mutates_args=())
    def _op_head_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor,
                          grad_loss: Tensor, label_smoothing: float, group_key: int, sequence_parallel: bool,
                          options: str, need_hidden: bool, need_weight: bool,
                          need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """The head's recompute backward: (grad_hidden, grad_weight, grad_bias), each in its
        input's dtype (an empty tensor where not needed); the hidden gradient's all-reduce
        (or all-gather and reduce-scatter) on the keyed group."""
        _check_head_op("linear_cross_entropy_backward", hidden, weight, bias, target, lse, grad_loss)
        grads = _head_backward(hidden, weight, bias, target, lse, grad_loss, label_smoothing,
                               _keyed_group(group_key), sequence_parallel, _decode_options(options),
                               (need_hidden, need_weight, need_bias))
        return tuple(_nothing(hidden) if g is None else g for g in grads)

    @_op_head_backward.register_fake
    def _(hidden, weight, bias, target, lse, grad_loss, label_smoothing, group_key, sequence_parallel, options,
          need_hidden, need_weight, need_bias):
        _check_head_op("linear_cross_entropy_backward", hidden, weight, bias, target, lse, grad_loss, real=False)
        return (hidden.new_empty(hidden.shape) if need_hidden else _nothing(hidden),
                weight.new_empty(weight.shape) if need_weight else _nothing(hidden),
                bias.new_empty(bias.shape) if need_bias and bias is not None else _nothing(hidden))

    def _setup_head(ctx, inputs, output):
        hidden, weight, bias, target, label_smoothing, group_key, sequence_parallel, options, _ = inputs
        ctx.save_for_backward(hidden, weight, bias, target, output[1])
        ctx.arguments = (label_smoothing, group_key, sequence_parallel, options)

    def _head_autograd(ctx, grad_loss, grad_lse):
        del grad_lse  # no gradient flows through the lse
        _first_derivative_only("linear_cross_entropy")
        hidden, weight, bias, target, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = (bool(n) for n in ctx.needs_input_grad[:3])
        need_bias = need_bias and bias is not None
        grad_hidden, grad_weight, grad_bias = torch.ops.vpce.linear_cross_entropy_backward(
            hidden, weight, bias, target, lse, grad_loss, *ctx.arguments, need_hidden, need_weight, need_bias)
        return (grad_hidden if need_hidden else None, grad_weight if need_weight else None,
                grad_bias if need_bias else None, None, None, None, None, None, None)

    torch.library.register_autograd("vpce::linear_cross_entropy_forward", _head_autograd, setup_context=_setup_head)

    @torch.library.custom_op("vpce::linear_cross_entropy_chunked", mutates_args=())
    def _op_head_chunked(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                         label_smoothing: float, group_key: int, sequence_parallel: bool, options: str,
                         need_hidden: bool, need_weight: bool,
                         need_bias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The head's chunked forward: (loss, grad_hidden, grad_weight, grad_bias), the
        gradients float32 for an upstream gradient of 1 (empty where not needed); every
        collective on the keyed group."""
        _check_head_op("linear_cross_entropy_chunked", hidden, weight, bias, target)
        loss, *grads = _head_chunked(hidden, weight, bias, target, label_smoothing, _keyed_group(group_key),
                                     sequence_parallel, _decode_options(options),
                                     (need_hidden, need_weight, need_bias))
        return (loss, *(_nothing(hidden).float() if g is None else g for g in grads))

    @_op_head_chunked.register_fake
    def _(hidden, weight, bias, target, label_smoothing, group_key, sequence_parallel, options, need_hidden,
          need_weight, need_bias):
        _check_head_op("linear_cross_entropy_chunked", hidden, weight, bias, target, real=False)
        f32 = torch.float32
        return (_fake_loss(hidden, target, options),
                hidden.new_empty(hidden.shape, dtype=f32) if need_hidden else _nothing(hidden).float(),
                weight.new_empty(weight.shape, dtype=f32) if need_weight else _nothing(hidden).float(),
                bias.new_empty(bias.shape, dtype=f32) if need_bias and bias is not None else _nothing(hidden).float())

    _register_chunked_autograd("vpce::linear_cross_entropy_chunked", "linear_cross_entropy", 1, 8)


def _fits_head_op(hidden, weight, bias, target, label_smoothing, options):
    """Whether the custom ops take these arguments: dense CPU or CUDA tensors of the dtypes
    the head reads, a float smoothing, JSON options, no gradient accumulation into
    main_grad (not an argument of the ops). Anything else takes the autograd.Function path,
    whose checks raise (the same error on every rank)."""
    tensors = (hidden, weight, target) if bias is None else (hidden, weight, target, bias)
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in tensors):
        return False
    if hidden.device.type not in ("cpu", "cuda") or any(t.device != hidden.device for t in tensors):
        return False
    if any(t.dtype != hidden.dtype for t in tensors if t is not target) or hidden.dtype not in _OPERAND_DTYPES:
        return False
    if weight.dim() != 2 or not 1 <= hidden.dim() <= 8 or (bias is not None and bias.dim() != 1):
        return False
    if target.dtype not in _TARGET_DTYPES + _WIDENED_TARGET_DTYPES:
        return False
    if not isinstance(label_smoothing, (float, int)) or isinstance(label_smoothing, bool):
        return False
    if options.get("gradient_accumulation_fusion", False) is not False:
        return False
    return all(isinstance(v, (int, float, str)) or (isinstance(v, (tuple, list)) and
                                                    all(isinstance(i, int) for i in v)) for v in options.values())


# ---- the public function ----------------------------------------------------------------

@_reverse_mode_only("hidden", "weight", "bias")
def linear_cross_entropy(hidden, weight, target, label_smoothing=0.0, tp_group=None, *, bias=None,
                         sequence_parallel=False, megatron_legacy_label_smoothing=False, **options):
    """The loss of the output layer's logits, hidden @ weight.T + bias, without building
    them: Megatron's output layer (ColumnParallelLinear over the vocabulary) and its
    vocab-parallel cross-entropy in one step.

    hidden: [s, b, H] (any leading shape, the tokens; float32, bfloat16 or float16;
        float64 computed in float32), the same on every rank of tp_group; with
        sequence_parallel=True, this rank's slice of the sequence [s/R, b, H] (dim 0),
        all-gathered in the forward as Megatron's layer does.
    weight: [V/R, H], this rank's rows of the output weight (rank r holds the vocabulary's
        rows [r V/R, (r+1) V/R), as ColumnParallelLinear); hidden's dtype.
    target: [s, b] global class ids (the whole sequence also with sequence_parallel).
    label_smoothing, tp_group: as vocab_parallel_cross_entropy's.
    bias: [V/R] or None.
    megatron_legacy_label_smoothing: Megatron's vocab_parallel_cross_entropy smoothing, over
        each rank's own rows (as vocab_parallel_cross_entropy's flag; the loss and the
        gradients differ by rank, as in Megatron).
    options: every loss option of vocab_parallel_cross_entropy (ignore_index,
        z_loss_weight, logit_scale, softcap, valid_vocab_size, smoothing_semantics,
        num_threads) and
        reduction: "none" (the default: the per-token loss [s, b]), "sum" or "mean" (over
            the tokens not ignored; 0 when none counts), a float32 scalar;
        mode: "recompute" (the default: the backward recomputes the logit tiles) or
            "chunked" (reduction "sum" or "mean" only: the forward computes the
            gradients too and the backward scales them; one backward per forward);
        token_block, vocab_block, chunk_tokens: the head's tile and chunk sizes
            (vpce/head.h's HeadOptions; 0 the default);
        bf16_logit_gradients: bfloat16 operands only; True rounds the logits' gradient to
            bfloat16 before the gradients' GEMMs, as PyTorch's bfloat16 paths do, so that
            those run on bfloat16 dot products (about a third faster where the CPU has
            AVX512-BF16; one tensor-core GEMM instead of two on CUDA). The loss does not
            change; the gradients then carry that rounding (False, the default: fp32);
        round_logits: bfloat16 and float16 operands; True rounds the logits to the operands'
            dtype before the loss, as a bf16 or fp16 output layer returns them
            (round(round(hidden @ weight.T) + bias)), to reproduce a bf16 or fp16 Megatron
            run's losses (with bf16_logit_gradients, its gradients too); False, the
            default: fp32 logits, the more exact;
        gradient_accumulation_fusion: True to add the weight's gradient into
            weight.main_grad (fp32), when the weight has one, as Megatron's layer does,
            and return None for it (or a dummy where weight.grad_added_to_main_grad
            exists, as Megatron);
        vocab_range: (vocab_begin, vocab_end, vocab_size) of this rank's rows, for
            slices of different sizes (the default is Megatron's equal slices).

    The gradient of hidden is summed over tp_group in the backward (an all-reduce; with
    sequence_parallel a reduce-scatter), so hidden must not also pass through Megatron's
    copy_to_tensor_model_parallel_region. Returns the loss in float32 (float64 for float64
    operands), the same on every rank.
    """
    if not isinstance(megatron_legacy_label_smoothing, bool):
        raise TypeError("megatron_legacy_label_smoothing: expected a bool, got "
                        f"{type(megatron_legacy_label_smoothing).__name__}")
    if megatron_legacy_label_smoothing:
        options = _legacy_options(label_smoothing, options)
    args = (hidden, weight, bias, target, label_smoothing, tp_group, sequence_parallel, options)
    if _CUSTOM_OPS and isinstance(sequence_parallel, bool) and _fits_head_op(hidden, weight, bias, target,
                                                                             label_smoothing, options):
        key, encoded = _group_key(tp_group), _encode_options(options)
        if options.get("mode", "recompute") == "chunked":
            if not _compiling():  # eager: the Function, which scales the gradients in place
                return _LinearCrossEntropy.apply(*args)
            needs = _needs(hidden, weight, bias)
            loss, *_ = torch.ops.vpce.linear_cross_entropy_chunked(hidden, weight, bias, target,
                                                                   float(label_smoothing), key, sequence_parallel,
                                                                   encoded, *needs)
            return loss
        loss, _ = torch.ops.vpce.linear_cross_entropy_forward(hidden, weight, bias, target, float(label_smoothing),
                                                              key, sequence_parallel, encoded,
                                                              _needs(hidden, weight, bias)[0])
        return loss
    return _LinearCrossEntropy.apply(*args)
