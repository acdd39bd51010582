"""vpce.torch: vpce as a drop-in for Megatron-LM's vocab-parallel cross-entropy.

    from vpce.torch import vocab_parallel_cross_entropy
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing, tp_group=group)

Same signature, shapes and return value as
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``: logits ``[s, b, V/R]`` on
each of the R ranks of ``tp_group`` (rank r holds columns ``[r V/R, (r+1) V/R)``), targets
``[s, b]`` of global class ids, the per-token loss ``[s, b]`` in float32 returned on every
rank. The forward makes one all-gather on ``tp_group`` instead of Megatron's three
all-reduces; the backward makes none, and only the per-token lse (4 bytes per token) is
kept between them, not a softmax of the logits' size. Label smoothing is exact across ranks
(Megatron's uses the shard's size and mean, so its loss differs between ranks);
``megatron_legacy_label_smoothing=True`` reproduces Megatron's values for anyone who needs
parity with a past run.

The all-gather carries one block per rank of a size the group agrees on (4096 bytes at
first): a 24-byte block header, then vpce's payload (a 256-byte header and 16 bytes per
token). A payload that outgrows the blocks costs one more gather, once, and every rank
grows them alike, since every rank sees every size. So ranks that disagree on the number of
tokens all get vpce's "ranks disagree" error, and a rank that fails before the gather (a
bad argument or option) still joins it with its error in its block: every rank then raises
that same error ("rank r of R: ..."), instead of leaving the others waiting for gloo's
timeout.

CPU tensors with a gloo (or any CPU-capable) process group; GPU tensors arrive with vpce's
CUDA build.

The module is also the whole of ``megatron.core.tensor_parallel.cross_entropy`` (every name
of its API): ``VocabParallelCrossEntropy`` and its static helpers (on vpce's SIMD row kernels
for CPU tensors, Megatron's torch operations elsewhere and under torch.compile),
``_VocabParallelCrossEntropy``, ``vocab_parallel_cross_entropy``, ``unfused_cross_entropy``,
and Megatron's fused branch, ``fused_vocab_parallel_cross_entropy``; so
``sys.modules["megatron.core.tensor_parallel.cross_entropy"] = vpce.torch`` before Megatron
is imported replaces it wholesale. On PyTorch >= 2.4 the loss is a torch.library custom
op (``vpce::cross_entropy_forward`` and ``vpce::cross_entropy_backward``, with fake
implementations and registered autograd), so ``torch.compile(fullgraph=True)`` traces it
without a graph break.
"""
from __future__ import annotations

import json
import struct
import sys
import weakref
from typing import Tuple

import torch
import torch.distributed as dist

from . import _vpce

__all__ = ["VocabParallelCrossEntropy", "_VocabParallelCrossEntropy", "vocab_parallel_cross_entropy",
           "unfused_cross_entropy", "fused_vocab_parallel_cross_entropy", "get_tensor_model_parallel_group",
           "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"]

_SEMANTICS = {"megatron": _vpce.SmoothingSemantics.MEGATRON, "pytorch": _vpce.SmoothingSemantics.PYTORCH}
_OPTION_NAMES = ("ignore_index", "z_loss_weight", "logit_scale", "softcap", "valid_vocab_size",
                 "smoothing_semantics", "num_threads")
_LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TARGET_DTYPES = (torch.int32, torch.int64)
_WIDENED_TARGET_DTYPES = tuple(getattr(torch, name) for name in ("int8", "int16", "uint8", "uint16", "uint32")
                               if hasattr(torch, name))  # int64 holds every value of these
_LEGACY_IGNORE_INDEX = -100  # the legacy path takes no options, so ignore_index keeps its default


def _parallel_state():
    """Megatron's parallel_state when Megatron has been imported (it cannot be initialised
    otherwise, so vpce never imports Megatron itself); else None."""
    return sys.modules.get("megatron.core.parallel_state")


def _megatron_state():
    state = _parallel_state()
    if state is None:
        raise RuntimeError("megatron.core.parallel_state: expected Megatron to be imported and initialised, got "
                           "no Megatron")
    return state


# Megatron's module imports these three from parallel_state; code (and Megatron's own tests)
# that patches them on this module changes what tp_group=None means here too.
def get_tensor_model_parallel_group(check_initialized=True):
    """Megatron's parallel_state.get_tensor_model_parallel_group."""
    return _megatron_state().get_tensor_model_parallel_group(check_initialized=check_initialized)


def get_tensor_model_parallel_rank():
    """Megatron's parallel_state.get_tensor_model_parallel_rank."""
    return _megatron_state().get_tensor_model_parallel_rank()


def get_tensor_model_parallel_world_size():
    """Megatron's parallel_state.get_tensor_model_parallel_world_size."""
    return _megatron_state().get_tensor_model_parallel_world_size()


def _megatron_initialised():
    state = _parallel_state()
    try:
        return state is not None and bool(state.model_parallel_is_initialized())
    except (AssertionError, RuntimeError, AttributeError):
        return False


def _default_group():
    """What tp_group=None means: Megatron's tensor-parallel group when Megatron is
    initialised, else torch.distributed's default group when it is initialised (torch's
    convention for group=None), else None (one rank)."""
    if _megatron_initialised():
        return get_tensor_model_parallel_group()
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _rank_and_size(group):
    """(rank, size) of an explicit group: a torch.distributed ProcessGroup, or any object
    with .rank() and .size() (Megatron's convention, get_pg_rank / get_pg_size)."""
    if hasattr(group, "rank") and hasattr(group, "size") and callable(group.size):
        return int(group.rank()), int(group.size())
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group=group), dist.get_world_size(group=group)
    raise TypeError(f"tp_group: expected a torch.distributed.ProcessGroup (or an object with .rank() and .size()), "
                    f"got {type(group).__name__}")


def _group(tp_group):
    """(group, rank, size): an explicit tp_group as given (one of size 1 needs nothing of
    torch.distributed), None as _default_group says; group None means one rank."""
    if tp_group is None:
        tp_group = _default_group()
        if tp_group is None:
            return None, 0, 1
    rank, size = _rank_and_size(tp_group)
    if size == 1:
        return None, 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"tp_group: expected an initialised torch.distributed for a group of {size} ranks, got "
                         "none initialised")
    if not 0 <= rank < size:
        raise ValueError(f"tp_group: expected a group this process belongs to, got rank {rank} of {size}")
    return tp_group, rank, size


# The forward's all-gather: one block per rank, [header][payload or its prefix][padding].
_BLOCK_HEADER = struct.Struct("<IIQd")  # magic, flags, payload bytes, legacy label smoothing
_BLOCK_MAGIC = 0x54435056  # "VPCT"
_FAILED = 1  # flags: this rank failed before the gather; its payload is "kind\nmessage"
_MIN_CAPACITY = 4096  # bytes per block at first
_ERROR_KINDS = {"TypeError": TypeError, "ValueError": ValueError, "Error": _vpce.Error}


class _Blocks:
    """A group's block size and gather buffers. The size changes only as a function of
    gathered bytes, which every rank sees alike, so it stays the same on every rank."""

    def __init__(self):
        self.capacity = _MIN_CAPACITY
        self._send = self._recv = None

    def buffers(self, ranks):
        """(send [capacity], recv [ranks, capacity]) uint8, reused while the size holds."""
        if self._send is None or self._send.numel() != self.capacity:
            self._send = torch.empty(self.capacity, dtype=torch.uint8)
            self._recv = torch.empty(ranks, self.capacity, dtype=torch.uint8)
        return self._send, self._recv

    def fit(self, largest):
        """Grows the blocks for the largest payload any rank sent, or shrinks them when
        payloads have become much smaller (so small calls carry little padding)."""
        wanted = _BLOCK_HEADER.size + largest
        if wanted > self.capacity or wanted * 4 < self.capacity:
            self.capacity = max(_MIN_CAPACITY, wanted)


_GROUP_BLOCKS = weakref.WeakKeyDictionary()


def _blocks(group):
    if group not in _GROUP_BLOCKS:
        _GROUP_BLOCKS[group] = _Blocks()
    return _GROUP_BLOCKS[group]


def _error_kind(error):
    """(kind, text) of an exception, for a failure block: TypeError and ValueError keep
    their class, anything else becomes vpce.Error."""
    if isinstance(error, _vpce.Error):
        return "Error", str(error)
    for kind in ("TypeError", "ValueError"):
        if isinstance(error, _ERROR_KINDS[kind]):
            return kind, str(error)
    return "Error", f"{type(error).__name__}: {error}"


class _Collective:
    """This rank's side of the forward's one all-gather on a process group: the callable
    vpce hands its payload to, and the way in for a rank that failed before it, so that
    every rank decides from the same gathered blocks and raises the same error."""

    def __init__(self, group, rank, size):
        self.group, self.rank, self.size = group, rank, size
        self.legacy_smoothing = 0.0  # sent in the block header, so that ranks must agree on it
        self.joined = False
        self.error = None  # the group's error, once the gathered blocks show one

    def __call__(self, send, recv):
        """vpce's all_gather(send, recv): every rank's payload into recv, rank 0's first."""
        payload = torch.frombuffer(send, dtype=torch.uint8)
        sizes, blocks = self._gather(0, payload)
        if self.error is not None:
            raise self.error
        own = payload.numel()
        out = torch.frombuffer(recv, dtype=torch.uint8).view(self.size, own)
        room = blocks.shape[1] - _BLOCK_HEADER.size
        for r, size in enumerate(sizes):
            # Sizes that disagree (a different number of tokens) leave each rank a prefix of
            # the others' payloads, with their vpce headers: vpce then reports the disagreement.
            kept = min(own, size, room)
            out[r, :kept] = blocks[r, _BLOCK_HEADER.size:_BLOCK_HEADER.size + kept]
            out[r, kept:] = 0

    def agreed(self, error):
        """The error this rank raises for `error`: the group's when the gather showed one;
        else, when this rank has not joined the gather yet, the one every rank learns by
        its joining with `error`; else `error` itself (vpce's own, the same on every rank)."""
        if self.error is None and not self.joined:
            kind, text = _error_kind(error)
            self._gather(_FAILED, torch.tensor(list(f"{kind}\n{text}".encode()), dtype=torch.uint8))
        return self.error if self.error is not None else error

    def _gather(self, flags, payload):
        """Gathers this rank's block; (every rank's payload size, the gathered blocks), and
        self.error set when the blocks show a failure or a disagreement."""
        self.joined = True
        blocks = _blocks(self.group)
        capacity = blocks.capacity
        gathered = self._exchange(blocks, flags, payload)
        headers = [_BLOCK_HEADER.unpack(bytes(gathered[r, :_BLOCK_HEADER.size].tolist())) for r in range(self.size)]
        self.error = self._group_error(headers, gathered)
        sizes = [header[2] for header in headers]
        blocks.fit(max(sizes))
        if self.error is None and len(set(sizes)) == 1 and _BLOCK_HEADER.size + sizes[0] > capacity:
            gathered = self._exchange(blocks, flags, payload)  # every rank's payload outgrew the blocks
        return sizes, gathered

    def _exchange(self, blocks, flags, payload):
        send, recv = blocks.buffers(self.size)
        header = _BLOCK_HEADER.pack(_BLOCK_MAGIC, flags, payload.numel(), self.legacy_smoothing)
        send[:_BLOCK_HEADER.size] = torch.tensor(list(header), dtype=torch.uint8)
        kept = min(payload.numel(), blocks.capacity - _BLOCK_HEADER.size)
        send[_BLOCK_HEADER.size:_BLOCK_HEADER.size + kept] = payload[:kept]
        dist.all_gather(list(recv.unbind(0)), send, group=self.group)
        return recv

    def _group_error(self, headers, gathered):
        """The error the gathered blocks show, the same on every rank; None when there is none."""
        for r, (magic, _, _, _) in enumerate(headers):
            if magic != _BLOCK_MAGIC:
                return _vpce.Error(f"invalid usage: all_gather: expected vpce.torch's block from rank {r}, got "
                                   "something else (another collective on tp_group, or another vpce version?)")
        for r, (_, flags, size, _) in enumerate(headers):
            if flags & _FAILED:
                end = _BLOCK_HEADER.size + min(size, gathered.shape[1] - _BLOCK_HEADER.size)
                message = bytes(gathered[r, _BLOCK_HEADER.size:end].tolist()).decode(errors="replace")
                kind, _, text = message.partition("\n")
                return _ERROR_KINDS.get(kind, _vpce.Error)(f"rank {r} of {self.size}: {text}")
        first = headers[0][3]
        for r, (_, _, _, smoothing) in enumerate(headers):
            if smoothing != first:
                return _vpce.Error(f"invalid usage: ranks disagree on label_smoothing (with "
                                   f"megatron_legacy_label_smoothing): expected rank 0's {first} on every rank, got "
                                   f"{smoothing} on rank {r}")
        return None


def _options(label_smoothing, options):
    """vpce.LossOptions from the keyword options; errors name the option."""
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"vocab_parallel_cross_entropy: unexpected options {unknown}; expected some of "
                        f"{list(_OPTION_NAMES)}")
    result = _vpce.LossOptions()
    result.label_smoothing = label_smoothing
    for name, value in options.items():
        if name == "smoothing_semantics":
            if not (isinstance(value, str) and value in _SEMANTICS):
                raise ValueError(f"smoothing_semantics: expected 'megatron' or 'pytorch', got {value!r}")
            value = _SEMANTICS[value]
        setattr(result, name, value)
    return result


def _check_logits(logits):
    """vocab_parallel_logits as vpce.torch takes them, else TypeError or ValueError naming
    what was expected and what they are."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"vocab_parallel_logits: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.layout != torch.strided:
        raise TypeError(f"vocab_parallel_logits.layout: expected torch.strided (a dense tensor), got {logits.layout}")
    if logits.device.type not in ("cpu", "cuda"):
        raise ValueError(f"vocab_parallel_logits.device: expected cpu or cuda, got {logits.device}")
    if logits.dtype not in _LOGITS_DTYPES:
        raise TypeError("vocab_parallel_logits.dtype: expected float32, bfloat16, float16 or float64, got "
                        f"{logits.dtype}")
    if not 1 <= logits.dim() <= 8:
        raise ValueError(f"vocab_parallel_logits.dim(): expected 1 to 8 dimensions ([..., V/R]), got {logits.dim()}")


def _as_targets(target, logits):
    """The targets as vpce reads them: int32 or int64 (narrower integers widened, which
    loses nothing), contiguous (a transposed or expanded target is copied, as PyTorch
    would); float and bool targets are refused rather than truncated."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor, got {type(target).__name__}")
    if target.layout != torch.strided:
        raise TypeError(f"target.layout: expected torch.strided (a dense tensor), got {target.layout}")
    if target.device != logits.device:
        raise ValueError(f"target.device: expected the logits' device {logits.device}, got {target.device}")
    if target.dtype in _WIDENED_TARGET_DTYPES:
        target = target.long()
    elif target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"target.dtype: expected int32 or int64 (or a narrower integer type, widened), got "
                        f"{target.dtype}")
    return target.contiguous()


def _real(value, name):
    """A number as a Python float, or TypeError naming it."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _legacy_smoothing(label_smoothing, options, logits):
    """The label smoothing of megatron_legacy_label_smoothing=True, checked as vpce checks
    its own: no other options, a value in [0, 1), and a shard of at least two columns
    (Megatron's formula divides by K - 1)."""
    if options:
        raise ValueError("megatron_legacy_label_smoothing: expected no other options (it reproduces Megatron's "
                         f"plain loss), got {sorted(options)}")
    alpha = _real(label_smoothing, "label_smoothing")
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1), got {alpha}")
    if alpha > 0.0 and logits.shape[-1] < 2:
        raise ValueError("megatron_legacy_label_smoothing: expected a shard of at least 2 columns (Megatron's "
                         f"smoothing divides by K - 1), got {logits.shape[-1]}")
    return alpha


def _check_inplace(logits):
    """inplace_backward=True as PyTorch allows an in-place op: not on a leaf that requires
    grad, nor on a view of one (the gradient would overwrite the parameter)."""
    base = logits if logits._base is None else logits._base
    if base.is_leaf and base.requires_grad:
        what = "a leaf" if base is logits else "a view of a leaf"
        raise ValueError("inplace_backward: expected logits that autograd lets be overwritten (the output of an "
                         f"operation, as Megatron's are), got {what} that requires grad")


def _as_rows(logits):
    """The logits as vpce reads them: a contiguous last dimension and leading dimensions that
    collapse to one row stride of at least the row's width (Megatron's [s, b, V/R],
    contiguous or a column slice of wider rows), read in place; anything else (float64,
    transposed, expanded, overlapping rows) is copied, as PyTorch's own ops would."""
    if logits.dtype == torch.float64:  # vpce's math is fp32 for every dtype
        logits = logits.float()
    width = logits.shape[-1]
    if logits.stride(-1) != 1 and width > 1:
        return logits.contiguous()
    dims = [(n, s) for n, s in zip(logits.shape[:-1], logits.stride()[:-1]) if n != 1]
    for (_, outer), (inner_n, inner_s) in zip(dims, dims[1:]):
        if outer != inner_s * inner_n:
            return logits.contiguous()
    if dims and dims[-1][1] < width:  # rows that overlap (stride 0: expanded)
        return logits.contiguous()
    return logits


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
    group, rank, size = _group(tp_group)
    if (size > 1 and isinstance(logits, torch.Tensor) and logits.device.type == "cpu"
            and dist.get_backend(group) == "nccl"):
        raise ValueError("tp_group: expected a process group that can gather CPU tensors (gloo), got NCCL "
                         "with CPU logits")
    collective = _Collective(group, rank, size) if size > 1 else None
    try:
        return _forward(ctx, collective, rank, size, logits, target, label_smoothing, inplace_backward,
                        legacy_smoothing, options)
    except Exception as error:
        agreed = error if collective is None else collective.agreed(error)
        if agreed is error:
            raise
        raise agreed from error


def _function_backward(ctx, grad_loss):
    x, y, lse = ctx.saved_tensors
    g = grad_loss.to(torch.float32).contiguous()
    grad = _gradient(x, y, lse, g, ctx.shard, ctx.smoothing, ctx.options, ctx.legacy_smoothing, ctx.inplace)
    if ctx.inplace and not ctx.legacy_smoothing:
        _increment_version(x)
    if ctx.input_dtype != grad.dtype:
        grad = grad.to(ctx.input_dtype)
    return grad


def _gradient(x, y, lse, g, shard, smoothing, options, legacy_smoothing, inplace):
    """The gradient of vpce's forward (no collective): over x when in place, else new."""
    opts = _options(smoothing, options)
    if legacy_smoothing:
        grad = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        _vpce.backward(x, y, lse, g, *shard, opts, grad)
        _legacy_grad(grad, y, g, shard, legacy_smoothing)
        return grad.to(x.dtype)
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
        return _function_backward(ctx, grad_output), None, None, None


def _forward(ctx, collective, rank, size, logits, target, label_smoothing, inplace, legacy, options):
    """The autograd forward: every check, then vpce's forward (its one collective through
    `collective`, None for one rank). Any error raised here reaches the other ranks."""
    loss, x, y, lse, shard, smoothing, alpha = _loss(collective, rank, size, logits, target, label_smoothing, inplace,
                                                     legacy, options)
    ctx.save_for_backward(x, y, lse)
    ctx.shard, ctx.smoothing, ctx.options = shard, smoothing, options  # plain values, not bound objects
    ctx.inplace = inplace
    ctx.legacy_smoothing = alpha
    ctx.input_dtype = logits.dtype
    return loss


def _loss(collective, rank, size, logits, target, label_smoothing, inplace, legacy, options):
    """Checks, then vpce's forward: (loss, x read, y read, lse, shard, smoothing, legacy alpha)."""
    _check_logits(logits)
    y = _as_targets(target, logits)
    alpha = _legacy_smoothing(label_smoothing, options, logits) if legacy else 0.0
    if inplace:
        _check_inplace(logits)
    smoothing = 0.0 if legacy else label_smoothing
    opts = _options(smoothing, options)
    x = _as_rows(logits)
    local = x.shape[-1]
    shard = (rank * local, (rank + 1) * local, size * local)
    loss = torch.empty(target.shape, dtype=torch.float32, device=x.device)
    lse = torch.empty(target.shape, dtype=torch.float32, device=x.device)
    if collective is not None:
        collective.legacy_smoothing = alpha
    _vpce.forward(x, y, *shard, opts, loss, lse, rank=rank, size=size, all_gather=collective)
    if alpha > 0:
        loss = _legacy_loss(x, y, lse, loss, alpha)
    loss = loss.double() if logits.dtype == torch.float64 else loss
    return loss, x, y, lse, shard, smoothing, alpha


_HUGE_PAGE = 2 << 20  # bytes


def _new_gradient(x):
    """A new contiguous tensor like x for the gradient. A CPU one of 2 MiB or more is placed
    on 2 MiB boundaries and advised onto transparent huge pages before the kernel first
    writes it: PyTorch's CPU allocator hands out fresh pages on every call, and faulting
    them in 4 KiB at a time costs far more than the backward itself (docs/performance.md).
    The tensor is a view of a slightly larger uint8 buffer (at most 4 MiB more address
    space, never touched)."""
    nbytes = x.numel() * x.element_size()
    if x.device.type != "cpu" or nbytes < _HUGE_PAGE:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rounded = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    buffer = torch.empty(rounded + _HUGE_PAGE, dtype=torch.uint8)
    offset = -buffer.data_ptr() % _HUGE_PAGE
    _vpce.advise_huge_pages(buffer.data_ptr() + offset, rounded)
    return buffer[offset:offset + nbytes].view(x.dtype).view(x.shape)


def _legacy_loss(x, y, lse, loss, alpha):
    """Megatron's loss with label smoothing: the shard's size K and the shard's mean
    log-probability, (1 - s) loss - s mean_v(z_v - lse) with s = alpha K / (K - 1); 0 for
    an ignored token, as vpce's own loss."""
    k = x.shape[-1]
    s = alpha * k / (k - 1)
    mean_log_probs = x.float().mean(dim=-1).reshape(lse.shape) - lse
    smoothed = (1.0 - s) * loss - s * mean_log_probs
    return smoothed.masked_fill(y.reshape(loss.shape) == _LEGACY_IGNORE_INDEX, 0.0)


def _legacy_grad(grad, y, g, shard, alpha):
    """Megatron's gradient with label smoothing: g (p - (1 - s) onehot - s / K), from vpce's
    g (p - onehot) (without smoothing), in place on the float32 `grad`; ignored tokens keep
    vpce's zero gradient."""
    begin, end, _ = shard
    k = end - begin
    s = alpha * k / (k - 1)
    rows = grad.view(-1, k)
    flat_y = y.reshape(-1).long()
    flat_g = g.reshape(-1).masked_fill(flat_y == _LEGACY_IGNORE_INDEX, 0.0)
    rows.sub_((flat_g * (s / k)).unsqueeze(-1))
    owned = (flat_y >= begin) & (flat_y < end)
    index = torch.nonzero(owned).squeeze(-1)
    rows[index, flat_y[index] - begin] += flat_g[index] * s


class VocabParallelCrossEntropy:
    """Computes the Cross Entropy Loss splitting the Vocab size across tensor parallel ranks.
    This implementation is used in both fused and unfused cross entropy implementations.

    Megatron's static helpers, each with Megatron's signature, in-place effects, return
    values, shapes and dtypes. On CPU tensors (dense rows, outside autograd recording and
    torch.compile) the max and the exponential run on vpce's SIMD row kernels (vpce/rows.h):
    the max widening bf16/fp16 to float32 in the same read, exp(x - max) in place in one
    pass (no separate subtraction); within 1 ulp of torch's. Anywhere else, and for
    everything else, they are Megatron's torch operations."""

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Calculates logits_max: (the logits as float32, the same tensor when they are
        float32 already, a new one otherwise; their max over the last dimension, float32)."""
        x = vocab_parallel_logits
        if _row_kernel_fits(x, (torch.float32, torch.bfloat16, torch.float16)):
            logits_max = torch.empty(x.shape[:-1], dtype=torch.float32)
            if x.dtype == torch.float32:
                _vpce.row_max(x, logits_max)
                return x, logits_max
            widened = torch.empty(x.shape, dtype=torch.float32)
            _vpce.row_max(x, logits_max, widened)
            return widened, logits_max
        vocab_parallel_logits = vocab_parallel_logits.float()
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        return vocab_parallel_logits, logits_max

    @staticmethod
    def gather_predicted_logits(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor,
                                vocab_start_index: int, vocab_end_index: int
                                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read-only part of the forward: (target_mask, masked_target_1d,
        predicted_logits): the mask of targets outside [vocab_start_index,
        vocab_end_index), the local target ids flattened (0 where masked), and
        logits[target] - logits_max with target's shape (0 where masked). Does not modify
        vocab_parallel_logits."""
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        logits_2d = vocab_parallel_logits.reshape(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d] - logits_max.reshape(-1)
        predicted_logits = predicted_logits_1d.contiguous().view_as(target)
        predicted_logits[target_mask] = 0.0
        return target_mask, masked_target_1d, predicted_logits

    @staticmethod
    def exp_logits_inplace(vocab_parallel_logits: torch.Tensor, logits_max: torch.Tensor) -> None:
        """In place: vocab_parallel_logits <- exp(vocab_parallel_logits - logits_max).
        Pointwise only; returns None."""
        if _row_kernel_fits(vocab_parallel_logits, (torch.float32,)) and _shift_fits(logits_max, vocab_parallel_logits):
            _vpce.exp_rows_in_place(vocab_parallel_logits, logits_max)
            return
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
        torch.exp(vocab_parallel_logits, out=vocab_parallel_logits)

    @staticmethod
    def calculate_predicted_logits(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                   logits_max: torch.Tensor, vocab_start_index: int, vocab_end_index: int
                                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Calculates predicted logits: (target_mask, masked_target_1d, predicted_logits,
        sum_exp_logits, exp_logits). vocab_parallel_logits is overwritten in place with
        exp(logits - logits_max) and returned as exp_logits."""
        x = vocab_parallel_logits
        if _row_kernel_fits(x, (torch.float32,)) and _shift_fits(logits_max, x) and target.shape == x.shape[:-1]:
            target_mask, masked_target_1d, predicted_logits = VocabParallelCrossEntropy.gather_predicted_logits(
                x, target, logits_max, vocab_start_index, vocab_end_index)
            # The sums as torch sums them (Megatron's order), so that they agree within an ulp:
            # the kernel's one-pass sums accumulate in float32 within a chunk, up to 3.5 ulps
            # from exact at K = 1200 where torch's are 2.6 (docs/performance.md).
            _vpce.exp_rows_in_place(x, logits_max)
            sum_exp_logits = x.sum(dim=-1)
            return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, x
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits_1d = predicted_logits_1d.clone().contiguous()
        predicted_logits = predicted_logits_1d.view_as(target)
        predicted_logits[target_mask] = 0.0
        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(exp_logits: torch.Tensor, predicted_logits: torch.Tensor,
                                     sum_exp_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Calculates cross entropy loss: (exp_logits divided in place by sum_exp_logits,
        so the softmax, the same tensor; log(sum_exp_logits) - predicted_logits)."""
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        return exp_logits, loss

    @staticmethod
    def prepare_gradient_calculation_operands(softmax: torch.Tensor, target_mask: torch.Tensor
                                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prepare gradient calculation operands: (grad_2d, a [N, K] view of softmax;
        arange_1d; softmax_update = 1 - target_mask as float32; grad_input, softmax itself)."""
        grad_input = softmax
        partition_vocab_size = softmax.size()[-1]
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        return grad_2d, arange_1d, softmax_update, grad_input

    @staticmethod
    def scale_gradients_inplace(grad_input: torch.Tensor, grad_output: torch.Tensor) -> None:
        """In place: grad_input <- grad_input * grad_output (per row). Pointwise only;
        returns None."""
        grad_input.mul_(grad_output.unsqueeze(dim=-1))

    @staticmethod
    def calculate_gradients(grad_2d: torch.Tensor, arange_1d: torch.Tensor, masked_target_1d: torch.Tensor,
                            softmax_update: torch.Tensor, grad_input: torch.Tensor, grad_output: torch.Tensor
                            ) -> torch.Tensor:
        """Calculates gradients in place in grad_input (grad_2d is a view of it): subtracts
        softmax_update at each row's target, scales rows by grad_output; returns grad_input."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input


def _row_kernel_fits(x, dtypes):
    """Whether vpce's row kernels take x: a contiguous CPU tensor of one of `dtypes` with at
    least one dimension and a non-empty last one, outside torch.compile and autograd
    recording (anything else gets Megatron's torch operations)."""
    return (isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype in dtypes and x.dim() >= 1
            and x.shape[-1] > 0 and x.is_contiguous() and x.layout == torch.strided
            and not (x.requires_grad and torch.is_grad_enabled()) and not _compiling())


def _shift_fits(shift, x):
    """A per-row float32 shift of shape x.shape[:-1], contiguous on the CPU."""
    return (isinstance(shift, torch.Tensor) and shift.dtype == torch.float32 and shift.device.type == "cpu"
            and shift.shape == x.shape[:-1] and shift.is_contiguous()
            and not (shift.requires_grad and torch.is_grad_enabled()))


def _compiling():
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    dynamo = getattr(torch, "_dynamo", None)
    return bool(dynamo is not None and hasattr(dynamo, "is_compiling") and dynamo.is_compiling())


# ---- torch.library custom ops (PyTorch >= 2.4) ------------------------------------------
# The group cannot be an operator argument: the ops take an integer key, 0 for tp_group=None
# (resolved when the op runs), others from _GROUP_KEYS (groups live as long as the process).
_GROUP_KEYS = {}
_KEYED_GROUPS = {}
_CUSTOM_OPS = hasattr(torch, "library") and hasattr(torch.library, "custom_op") and hasattr(
    torch.library, "register_autograd")


def _constant(function):
    """Called once while torch.compile traces, its result a constant of the graph."""
    dynamo = getattr(torch, "_dynamo", None) if _CUSTOM_OPS else None
    return dynamo.assume_constant_result(function) if dynamo is not None else function


@_constant
def _group_key(tp_group):
    if tp_group is None:
        return 0
    key = _GROUP_KEYS.get(tp_group)
    if key is None:
        key = _GROUP_KEYS[tp_group] = len(_GROUP_KEYS) + 1
        _KEYED_GROUPS[key] = tp_group
    return key


@_constant
def _encode_options(options):
    return json.dumps(options, sort_keys=True) if options else ""


def _decode_options(text):
    return json.loads(text) if text else {}


def _op_forward_impl(logits, target, label_smoothing, group_key, inplace, legacy, options):
    """(loss, lse): what _VpceCrossEntropy's forward computes, errors agreed across the group."""
    del inplace  # for the autograd context only
    tp_group = _KEYED_GROUPS[group_key] if group_key else None
    ctx = _Saved()
    loss = _function_forward(ctx, logits, target, label_smoothing, tp_group, False, legacy, _decode_options(options))
    return loss, ctx.lse


class _Saved:
    """A stand-in autograd context for _function_forward inside the custom op."""

    def save_for_backward(self, x, y, lse):
        self.lse = lse


def _op_shard(logits, group_key):
    tp_group = _KEYED_GROUPS[group_key] if group_key else None
    _, rank, size = _group(tp_group)
    local = logits.shape[-1]
    return rank * local, (rank + 1) * local, size * local


def _op_backward_impl(logits, target, lse, grad_loss, label_smoothing, group_key, legacy, options):
    options = _decode_options(options)
    x = _as_rows(logits)
    y = _as_targets(target, logits)
    alpha = _legacy_smoothing(label_smoothing, options, logits) if legacy else 0.0
    smoothing = 0.0 if legacy else label_smoothing
    g = grad_loss.to(torch.float32).contiguous()
    grad = _gradient(x, y, lse, g, _op_shard(logits, group_key), smoothing, options, alpha, False)
    if grad.dtype != logits.dtype:
        grad = grad.to(logits.dtype)
    if grad.shape != logits.shape or not grad.is_contiguous():
        grad = grad.contiguous().view(logits.shape)
    return grad


if _CUSTOM_OPS:
    from torch import Tensor  # noqa: E402

    @torch.library.custom_op("vpce::cross_entropy_forward", mutates_args=())
    def _op_forward(logits: Tensor, target: Tensor, label_smoothing: float, group_key: int, inplace: bool,
                    legacy: bool, options: str) -> Tuple[Tensor, Tensor]:
        """vpce's forward: (per-token loss, lse); the one all-gather on the keyed group."""
        loss, lse = _op_forward_impl(logits, target, label_smoothing, group_key, inplace, legacy, options)
        return loss, lse

    @_op_forward.register_fake
    def _(logits, target, label_smoothing, group_key, inplace, legacy, options):
        loss_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return (logits.new_empty(target.shape, dtype=loss_dtype), logits.new_empty(target.shape, dtype=torch.float32))

    @torch.library.custom_op("vpce::cross_entropy_backward", mutates_args=())
    def _op_backward(logits: Tensor, target: Tensor, lse: Tensor, grad_loss: Tensor, label_smoothing: float,
                     group_key: int, legacy: bool, options: str) -> Tensor:
        """vpce's backward: the gradient of the loss for the logits, a new contiguous tensor
        in their dtype; no collective."""
        return _op_backward_impl(logits, target, lse, grad_loss, label_smoothing, group_key, legacy, options)

    @_op_backward.register_fake
    def _(logits, target, lse, grad_loss, label_smoothing, group_key, legacy, options):
        return logits.new_empty(logits.shape)

    def _setup_context(ctx, inputs, output):
        logits, target, label_smoothing, group_key, _inplace, legacy, options = inputs
        ctx.save_for_backward(logits, target, output[1])
        ctx.arguments = (label_smoothing, group_key, legacy, options)

    def _op_autograd(ctx, grad_loss, grad_lse):
        del grad_lse  # lse is an implementation detail: no gradient flows through it
        logits, target, lse = ctx.saved_tensors
        grad = torch.ops.vpce.cross_entropy_backward(logits, target, lse, grad_loss, *ctx.arguments)
        return grad, None, None, None, None, None, None

    torch.library.register_autograd("vpce::cross_entropy_forward", _op_autograd, setup_context=_setup_context)


def _fits_op(logits, target, label_smoothing, options):
    """Whether the custom op takes these arguments: dense CPU or CUDA tensors of the dtypes
    vpce reads, a float smoothing, JSON options. Anything else takes the autograd.Function
    path, whose checks raise (the same error on every rank)."""
    if not (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor)):
        return False
    if logits.layout != torch.strided or target.layout != torch.strided:
        return False
    if logits.device.type not in ("cpu", "cuda") or target.device != logits.device:
        return False
    if logits.dtype not in _LOGITS_DTYPES or not 1 <= logits.dim() <= 8:
        return False
    if target.dtype not in _TARGET_DTYPES + _WIDENED_TARGET_DTYPES:
        return False
    if not isinstance(label_smoothing, (float, int)) or isinstance(label_smoothing, bool):
        return False
    return all(isinstance(v, (int, float, str)) for v in options.values())


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None, *,
                                 inplace_backward=False, megatron_legacy_label_smoothing=False, **options):
    """Per-token cross-entropy of logits split over the vocabulary across `tp_group`.

    vocab_parallel_logits: [s, b, V/R] (any leading shape, 1 to 8 dimensions), float32,
        bfloat16 or float16 (float64 is computed in float32, as every dtype is); rank r
        holds columns [r V/R, (r+1) V/R). Read in place when its rows have one stride;
        copied otherwise (transposed, expanded, overlapping), as PyTorch would.
    target: [s, b] global class ids, int64 or int32 (narrower integer types are widened;
        float and bool targets are refused); copied when not contiguous.
    label_smoothing: in [0, 1); Megatron's meaning (target 1 - a, every other class
        a / (V - 1)) over the global vocabulary; smoothing_semantics="pytorch" for
        F.cross_entropy's.
    tp_group: the tensor-parallel process group, used as given (any object with .rank()
        and .size() when its size is 1); None means Megatron's tensor-parallel group when
        Megatron is initialised, else torch.distributed's default group when it is
        initialised, else a single rank.
    inplace_backward: write the gradient over the logits (as Megatron does) instead of a
        new tensor; only when nothing else needs the logits afterwards: autograd's version
        counter is bumped, so a backward that still needs them (a second one, or another
        op's that saved them) raises. Refused for a leaf that requires grad (or a view of
        one). Where the logits had to be copied (float64, transposed, expanded), the
        gradient is written into that copy, which saves no memory. Under torch.compile the
        gradient is a new tensor (a compiled graph does not overwrite what it saved).
    megatron_legacy_label_smoothing: reproduce Megatron's smoothed values (shard size and
        shard mean, different on every rank) for parity with a past run; no other options,
        label_smoothing in [0, 1) and the same on every rank, at least 2 columns per shard;
        tokens with target -100 get loss 0 and no gradient.
    options: ignore_index (-100), z_loss_weight, logit_scale, softcap, valid_vocab_size,
        smoothing_semantics ("megatron" or "pytorch"), num_threads.

    Returns the float32 loss with target's shape, the same on every rank. An error on any
    rank is raised on every rank, with the same text.
    """
    compiling = _CUSTOM_OPS and _compiling()
    if (_CUSTOM_OPS and (compiling or not inplace_backward)
            and _fits_op(vocab_parallel_logits, target, label_smoothing, options)):
        loss, _ = torch.ops.vpce.cross_entropy_forward(vocab_parallel_logits, target, float(label_smoothing),
                                                       _group_key(tp_group), bool(inplace_backward),
                                                       bool(megatron_legacy_label_smoothing),
                                                       _encode_options(options))
        return loss
    return _VpceCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group, inplace_backward,
                                   megatron_legacy_label_smoothing, options)


def unfused_cross_entropy(logits, labels, tp_group=None):
    """Adapt vocab-parallel cross entropy to the backend target signature: Megatron's
    unfused_cross_entropy, vocab_parallel_cross_entropy without smoothing (the group by
    keyword, since the kernel's third positional argument is label_smoothing)."""
    return vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group)


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
    """Megatron's fused branch (megatron.core.fusions.fused_cross_entropy), with its
    signature: the plain loss over tp_group. vpce is one fused pass already, so this is
    vocab_parallel_cross_entropy(vocab_parallel_logits, target, 0.0, tp_group); the gradient
    comes in the logits' dtype (Megatron's fused backward always rounds it to bfloat16)."""
    return vocab_parallel_cross_entropy(vocab_parallel_logits, target, 0.0, tp_group)


# ---- The wholesale swap -------------------------------------------------------------------
# sys.modules["megatron.core.tensor_parallel.cross_entropy"] = vpce.torch, before Megatron is
# imported, replaces Megatron's module. Megatron's own module imports parallel_state first, and
# megatron-core's import order depends on that (megatron.core.utils and parallel_state import
# each other; parallel_state must start first). So when Megatron's package looks this module
# up in sys.modules (importlib reads its __spec__._initializing) while megatron.core is still
# being imported, parallel_state is imported first, just as from Megatron's own module.
class _SwapSpec(type(__spec__)):
    _importing = False

    @property
    def _initializing(self):
        if (not _SwapSpec._importing and "megatron.core" in sys.modules
                and "megatron.core.parallel_state" not in sys.modules
                and sys.modules.get("megatron.core.tensor_parallel.cross_entropy") is sys.modules.get(__name__)):
            _SwapSpec._importing = True
            try:
                import megatron.core.parallel_state  # noqa: F401, PLC0415
            finally:
                _SwapSpec._importing = False
        return self.__dict__.get("_vpce_initializing", False)

    @_initializing.setter
    def _initializing(self, value):
        self.__dict__["_vpce_initializing"] = value


if __spec__ is not None and type(__spec__) is not _SwapSpec:
    _initializing_now = getattr(__spec__, "_initializing", False)
    __spec__.__class__ = _SwapSpec
    __spec__._initializing = _initializing_now
