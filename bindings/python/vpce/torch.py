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
"""
from __future__ import annotations

import struct
import weakref

import torch
import torch.distributed as dist

from . import _vpce

__all__ = ["vocab_parallel_cross_entropy", "unfused_cross_entropy"]

_SEMANTICS = {"megatron": _vpce.SmoothingSemantics.MEGATRON, "pytorch": _vpce.SmoothingSemantics.PYTORCH}
_OPTION_NAMES = ("ignore_index", "z_loss_weight", "logit_scale", "softcap", "valid_vocab_size",
                 "smoothing_semantics", "num_threads")
_LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TARGET_DTYPES = (torch.int32, torch.int64)
_WIDENED_TARGET_DTYPES = tuple(getattr(torch, name) for name in ("int8", "int16", "uint8", "uint16", "uint32")
                               if hasattr(torch, name))  # int64 holds every value of these
_LEGACY_IGNORE_INDEX = -100  # the legacy path takes no options, so ignore_index keeps its default


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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, tp_group, inplace_backward, legacy_smoothing, options):
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
            if ctx.inplace:
                _increment_version(x)
        if ctx.input_dtype != grad.dtype:
            grad = grad.to(ctx.input_dtype)
        return grad, None, None, None, None, None, None


def _forward(ctx, collective, rank, size, logits, target, label_smoothing, inplace, legacy, options):
    """The autograd forward: every check, then vpce's forward (its one collective through
    `collective`, None for one rank). Any error raised here reaches the other ranks."""
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
    ctx.save_for_backward(x, y, lse)
    ctx.shard, ctx.smoothing, ctx.options = shard, smoothing, options  # plain values, not bound objects
    ctx.inplace = inplace
    ctx.legacy_smoothing = alpha
    ctx.input_dtype = logits.dtype
    return loss.double() if logits.dtype == torch.float64 else loss


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
    tp_group: the tensor-parallel process group; None means Megatron's current group when
        Megatron is initialised, else a single rank.
    inplace_backward: write the gradient over the logits (as Megatron does) instead of a
        new tensor; only when nothing else needs the logits afterwards: autograd's version
        counter is bumped, so a backward that still needs them (a second one, or another
        op's that saved them) raises. Refused for a leaf that requires grad (or a view of
        one). Where the logits had to be copied (float64, transposed, expanded), the
        gradient is written into that copy, which saves no memory.
    megatron_legacy_label_smoothing: reproduce Megatron's smoothed values (shard size and
        shard mean, different on every rank) for parity with a past run; no other options,
        label_smoothing in [0, 1) and the same on every rank, at least 2 columns per shard;
        tokens with target -100 get loss 0 and no gradient.
    options: ignore_index (-100), z_loss_weight, logit_scale, softcap, valid_vocab_size,
        smoothing_semantics ("megatron" or "pytorch"), num_threads.

    Returns the float32 loss with target's shape, the same on every rank. An error on any
    rank is raised on every rank, with the same text.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group,
                                            inplace_backward, megatron_legacy_label_smoothing, options)


def unfused_cross_entropy(logits, labels, tp_group=None):
    """Megatron's unfused_cross_entropy: vocab_parallel_cross_entropy without smoothing."""
    return vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group)
