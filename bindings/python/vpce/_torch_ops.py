"""The loss as torch.library custom ops (PyTorch >= 2.4): vpce::cross_entropy_forward and
vpce::cross_entropy_backward, with fake implementations and registered autograd, so that
torch.compile(fullgraph=True) traces it without a graph break; and which arguments they
take."""
from __future__ import annotations

import itertools
import json
from typing import Tuple

import torch

from ._torch_arguments import (_GRADIENT_DTYPES, _LOGITS_DTYPES, _LSE_DTYPES, _TARGET_DTYPES, _WIDENED_TARGET_DTYPES,
                               _as_rows, _as_targets, _check_op_tensors, _first_derivative_only)
from ._torch_compile import _CUSTOM_OPS, _compiling, _constant
from ._torch_function import _function_forward, _gradient
from ._torch_groups import _group
from ._torch_legacy import _legacy_options

# The group cannot be an operator argument: the ops take an integer key, 0 for tp_group=None
# (resolved when the op runs), others for the group's name (ProcessGroup.group_name, the same
# on every rank, which torch.compile reads as a constant). While torch.compile traces, the
# group is a stand-in that cannot run a collective, so the op finds the real group by its
# name when it runs (torch.distributed keeps every group by name, as its functional
# collectives find them); a group seen in an eager call is kept as it is.
_NAME_KEYS = {}
_KEYED_NAMES = {}
_OBJECT_KEYS = {}
_KEYED_GROUPS = {}
_NEXT_KEY = itertools.count(1)


@_constant
def _key_of_group_name(name):
    key = _NAME_KEYS.get(name)
    if key is None:
        key = _NAME_KEYS[name] = next(_NEXT_KEY)
        _KEYED_NAMES[key] = name
    return key


@_constant
def _key_of_object(group):
    """A group object without a name (one with only rank() and size(), of size 1), keyed as
    itself: torch.compile hands such a plain object to this function as it is."""
    key = _OBJECT_KEYS.get(group)
    if key is None:
        key = _OBJECT_KEYS[group] = next(_NEXT_KEY)
        _KEYED_GROUPS[key] = group
    return key


def _group_key(tp_group):
    if tp_group is None:
        return 0
    name = getattr(tp_group, "group_name", None)
    if not isinstance(name, str):
        return _key_of_object(tp_group)
    key = _key_of_group_name(name)
    if not _compiling():
        _KEYED_GROUPS[key] = tp_group  # (the latest: a group of that name made again after destroy_process_group)
    return key


def _keyed_group(group_key):
    """The process group of a key from _group_key (None for 0)."""
    if not group_key:
        return None
    group = _KEYED_GROUPS.get(group_key)
    if group_key in _KEYED_NAMES and (group is None or not _registered(group)):
        from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: PLC0415

        group = _KEYED_GROUPS[group_key] = _resolve_process_group(_KEYED_NAMES[group_key])
    return group


def _registered(group):
    """Whether torch.distributed still knows `group` (not after destroy_process_group)."""
    from torch.distributed import distributed_c10d  # noqa: PLC0415

    world = getattr(distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    return pg_map is None or group in pg_map


@_constant
def _encode_options(options):
    return json.dumps(options, sort_keys=True) if options else ""


def _decode_options(text):
    return json.loads(text) if text else {}


def _op_forward_impl(logits, target, label_smoothing, group_key, inplace, legacy, options):
    """(loss, lse): what _VpceCrossEntropy's forward computes, errors agreed across the group."""
    del inplace  # for the autograd context only
    tp_group = _keyed_group(group_key)
    ctx = _Saved()
    loss = _function_forward(ctx, logits, target, label_smoothing, tp_group, False, legacy, _decode_options(options))
    return loss, ctx.lse


class _Saved:
    """A stand-in autograd context for _function_forward inside the custom op."""

    def save_for_backward(self, x, y, lse):
        self.lse = lse


def _op_shard(logits, group_key):
    tp_group = _keyed_group(group_key)
    _, rank, size = _group(tp_group)
    local = logits.shape[-1]
    return rank * local, (rank + 1) * local, size * local


def _op_backward_impl(logits, target, lse, grad_loss, label_smoothing, group_key, legacy, options):
    options = _decode_options(options)
    x = _as_rows(logits)
    y = _as_targets(target, logits)
    if legacy:
        options = _legacy_options(label_smoothing, options)
    g = grad_loss.to(torch.float32).contiguous()
    grad = _gradient(x, y, lse, g, _op_shard(logits, group_key), label_smoothing, options, False)
    if grad.dtype != logits.dtype:
        grad = grad.to(logits.dtype)
    if grad.shape != logits.shape or not grad.is_contiguous():
        grad = grad.contiguous().view(logits.shape)
    return grad


def _check_op_forward(logits, target, real=True):
    _check_op_tensors("vpce::cross_entropy_forward", "logits", logits,
                      (("logits", logits, _LOGITS_DTYPES), ("target", target, _TARGET_DTYPES + _WIDENED_TARGET_DTYPES)), real)


def _check_op_backward(logits, target, lse, grad_loss, real=True):
    _check_op_tensors("vpce::cross_entropy_backward", "logits", logits,
                      (("logits", logits, _LOGITS_DTYPES), ("target", target, _TARGET_DTYPES + _WIDENED_TARGET_DTYPES),
                       ("lse", lse, _LSE_DTYPES), ("grad_loss", grad_loss, _GRADIENT_DTYPES)), real)


if _CUSTOM_OPS:
    from torch import Tensor  # noqa: E402

    @torch.library.custom_op("vpce::cross_entropy_forward", mutates_args=())
    def _op_forward(logits: Tensor, target: Tensor, label_smoothing: float, group_key: int, inplace: bool,
                    legacy: bool, options: str) -> Tuple[Tensor, Tensor]:
        """vpce's forward: (per-token loss, lse); the one all-gather on the keyed group."""
        _check_op_forward(logits, target)
        loss, lse = _op_forward_impl(logits, target, label_smoothing, group_key, inplace, legacy, options)
        return loss, lse

    @_op_forward.register_fake
    def _(logits, target, label_smoothing, group_key, inplace, legacy, options):
        _check_op_forward(logits, target, real=False)
        loss_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return (logits.new_empty(target.shape, dtype=loss_dtype), logits.new_empty(target.shape, dtype=torch.float64))

    @torch.library.custom_op("vpce::cross_entropy_backward", mutates_args=())
    def _op_backward(logits: Tensor, target: Tensor, lse: Tensor, grad_loss: Tensor, label_smoothing: float,
                     group_key: int, legacy: bool, options: str) -> Tensor:
        """vpce's backward: the gradient of the loss for the logits, a new contiguous tensor
        in their dtype; no collective."""
        _check_op_backward(logits, target, lse, grad_loss)
        return _op_backward_impl(logits, target, lse, grad_loss, label_smoothing, group_key, legacy, options)

    @_op_backward.register_fake
    def _(logits, target, lse, grad_loss, label_smoothing, group_key, legacy, options):
        _check_op_backward(logits, target, lse, grad_loss, real=False)
        return logits.new_empty(logits.shape)

    def _setup_context(ctx, inputs, output):
        logits, target, label_smoothing, group_key, _inplace, legacy, options = inputs
        ctx.save_for_backward(logits, target, output[1])
        ctx.arguments = (label_smoothing, group_key, legacy, options)

    def _op_autograd(ctx, grad_loss, grad_lse):
        del grad_lse  # lse is an implementation detail: no gradient flows through it
        _first_derivative_only("vocab_parallel_cross_entropy")
        logits, target, lse = ctx.saved_tensors
        grad = torch.ops.vpce.cross_entropy_backward(logits, target, lse, grad_loss, *ctx.arguments)
        return grad, None, None, None, None, None, None

    torch.library.register_autograd("vpce::cross_entropy_forward", _op_autograd, setup_context=_setup_context)


def _without_data(tensor):
    """Whether `tensor` has shapes but no values (a fake tensor, as torch.compile and
    FakeTensorMode make, or one on the meta device): only the op's fake implementation
    can take it."""
    if not isinstance(tensor, torch.Tensor):
        return False
    if tensor.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415

    return isinstance(tensor, FakeTensor)


def _fits_op(logits, target, label_smoothing, options):
    """Whether the custom op takes these arguments: dense CPU or CUDA tensors of the dtypes
    vpce reads, a float smoothing, JSON options. Anything else takes the autograd.Function
    path, whose checks raise (the same error on every rank)."""
    if not (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor)):
        return False
    if logits.layout != torch.strided or target.layout != torch.strided:
        return False
    if logits.device.type not in ("cpu", "cuda", "meta") or target.device != logits.device:
        return False
    if logits.dtype not in _LOGITS_DTYPES or not 1 <= logits.dim() <= 8:
        return False
    if target.dtype not in _TARGET_DTYPES + _WIDENED_TARGET_DTYPES:
        return False
    if not isinstance(label_smoothing, (float, int)) or isinstance(label_smoothing, bool):
        return False
    return all(isinstance(v, (int, float, str)) for v in options.values())
