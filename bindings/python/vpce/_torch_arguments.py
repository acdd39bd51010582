"""vpce.torch's arguments as vpce reads them: the keyword options as vpce.LossOptions, the
logits and targets checked (errors name what was expected and what was given) and laid out
as vpce's kernels take them, and the in-place gradient's precondition."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.autograd.forward_ad as forward_ad

from . import _vpce
from ._torch_compile import _compiling

_SEMANTICS = {"megatron": _vpce.SmoothingSemantics.MEGATRON, "pytorch": _vpce.SmoothingSemantics.PYTORCH,
              "megatron_legacy": _vpce.SmoothingSemantics.MEGATRON_LEGACY}
_OPTION_NAMES = ("ignore_index", "z_loss_weight", "logit_scale", "softcap", "valid_vocab_size",
                 "smoothing_semantics", "num_threads")
_LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TARGET_DTYPES = (torch.int32, torch.int64)
_WIDENED_TARGET_DTYPES = tuple(getattr(torch, name) for name in ("int8", "int16", "uint8", "uint16", "uint32")
                               if hasattr(torch, name))  # int64 holds every value of these


def _options(label_smoothing, options):
    """vpce.LossOptions from the keyword options; errors name the option."""
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"vocab_parallel_cross_entropy: unexpected options {unknown}; expected some of "
                        f"{list(_OPTION_NAMES)}")
    result = _vpce.LossOptions()
    result.label_smoothing = _real(label_smoothing, "label_smoothing")
    for name, value in options.items():
        if name == "smoothing_semantics":
            if not (isinstance(value, str) and value in _SEMANTICS):
                raise ValueError(f"smoothing_semantics: expected 'megatron', 'pytorch' or 'megatron_legacy', got "
                                 f"{value!r}")
            value = _SEMANTICS[value]
        setattr(result, name, value)
    return result


def _check_float_tensor(name, tensor, dims=None, shape=""):
    """A floating-point operand as vpce.torch takes it (the logits, the head's hidden, weight
    and bias): a dense CPU or CUDA tensor of float32, bfloat16, float16 or float64 with
    dims[0] to dims[1] dimensions (any when dims is None; `shape` says which, as " ([..., V/R])"),
    else TypeError or ValueError naming what was expected and what it is."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name}.layout: expected torch.strided (a dense tensor), got {tensor.layout}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}.device: expected cpu or cuda, got {tensor.device}")
    if tensor.dtype not in _LOGITS_DTYPES:
        raise TypeError(f"{name}.dtype: expected float32, bfloat16, float16 or float64, got {tensor.dtype}")
    if dims is not None and not dims[0] <= tensor.dim() <= dims[1]:
        wanted = str(dims[0]) if dims[0] == dims[1] else f"{dims[0]} to {dims[1]} dimensions"
        raise ValueError(f"{name}.dim(): expected {wanted}{shape}, got {tensor.dim()}")


def _check_logits(logits):
    """vocab_parallel_logits as vpce.torch takes them, else TypeError or ValueError naming
    what was expected and what they are."""
    _check_float_tensor("vocab_parallel_logits", logits, (1, 8), " ([..., V/R])")


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
    """A number as a Python float, or TypeError naming it; a tensor that requires grad is
    refused (vpce gives it no gradient: it would be None, silently)."""
    if isinstance(value, (str, bytes, bool)) or not hasattr(value, "__float__"):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise ValueError(f"{name}: expected a number or a tensor that does not require grad (no gradient flows to "
                         f"{name}: detach it), got one that requires grad")
    try:
        return float(value)
    except OverflowError:  # an integer beyond float64
        raise ValueError(f"{name}: expected a number that float32 holds, got {value!r}") from None


def _reverse_mode_only(*operands):
    """Decorates a function of vpce.torch so that an operand (named in `operands`) carrying a
    forward-mode tangent (torch.func.jvp, torch.autograd.forward_ad) raises NotImplementedError
    naming the function: vpce's derivatives are reverse mode only, and a custom op without a
    forward-mode formula gives a tangent of zeros, silently. The call first runs on the
    operands' primal values, so that this rank takes part in the collective as the others do
    (an error before it would leave them waiting)."""
    def wrap(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def call(*args, **kwargs):
            if _compiling():
                return function(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            dual = [name for name in operands if isinstance(bound.arguments.get(name), torch.Tensor)
                    and forward_ad.unpack_dual(bound.arguments[name]).tangent is not None]
            if not dual:
                return function(*args, **kwargs)
            for name in dual:
                bound.arguments[name] = forward_ad.unpack_dual(bound.arguments[name]).primal
            cause = None
            try:  # (inside torch.func's transforms the autograd.Function path refuses to run)
                function(*bound.args, **bound.kwargs)
            except Exception as error:  # noqa: BLE001 (the refusal below is the one to report)
                cause = error
            raise NotImplementedError(f"{function.__name__}: expected operands without a forward-mode tangent "
                                      "(vpce's derivatives are reverse mode only: backward, torch.autograd.grad), "
                                      f"got one in {dual} from torch.func.jvp or torch.autograd.forward_ad") from cause
        return call
    return wrap


def _check_inplace(logits):
    """inplace_backward=True as PyTorch allows an in-place op: not on a leaf that requires
    grad, nor on a view of one (the gradient would overwrite the parameter)."""
    base = logits if logits._base is None else logits._base
    if base.is_leaf and base.requires_grad:
        what = "a leaf" if base is logits else "a view of a leaf"
        raise ValueError("inplace_backward: expected logits that autograd lets be overwritten (the output of an "
                         f"operation, as Megatron's are), got {what} that requires grad")


def _as_float32(tensor, name):
    """A float64 tensor rounded to float32 (vpce's math is fp32 for every dtype); ValueError
    naming it where a finite value lies beyond float32's range, which would become inf and
    make the results NaN."""
    rounded = tensor.float()
    overflowed = torch.isinf(rounded)
    if overflowed.any() and (overflowed & torch.isfinite(tensor)).any():
        largest = tensor[torch.isfinite(tensor)].abs().max().item()
        raise ValueError(f"{name}: expected float64 values within float32's range (vpce computes in float32: "
                         f"|x| <= 3.4028235e38), got one of magnitude {largest:.6g}")
    return rounded


def _as_rows(logits, name="vocab_parallel_logits"):
    """The logits as vpce reads them: a contiguous last dimension and leading dimensions that
    collapse to one row stride of at least the row's width (Megatron's [s, b, V/R],
    contiguous or a column slice of wider rows), read in place; anything else (float64,
    transposed, expanded, overlapping rows) is copied, as PyTorch's own ops would."""
    if logits.dtype == torch.float64:
        logits = _as_float32(logits, name)
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


_LSE_DTYPES = (torch.float64, torch.float32)
_GRADIENT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_op_tensors(op, reference_name, reference, tensors, real):
    """The tensors of a custom op as its implementations take them: each of (name, tensor or
    None, dtypes) on the device of `reference` (named reference_name), a CPU or CUDA device
    for the real implementation (`real`; the fake one also takes meta tensors), and of one
    of `dtypes`; else ValueError or TypeError naming the op and the argument, as PyTorch's
    own ops refuse a tensor on another device (a meta tensor among CPU ones would otherwise
    give uninitialised memory)."""
    if real and reference.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: {reference_name}.device: expected cpu or cuda, got {reference.device}")
    for name, tensor, dtypes in tensors:
        if tensor is None:
            continue
        if tensor.device != reference.device:
            raise ValueError(f"{op}: {name}.device: expected {reference.device} (the device of {reference_name}), "
                             f"got {tensor.device}")
        if tensor.dtype not in dtypes:
            expected = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{op}: {name}.dtype: expected one of {expected}, got {tensor.dtype}")


def _first_derivative_only(name):
    """Raises in a backward run with create_graph=True (grad mode on there), whose gradients
    would carry no second derivative: a gradient penalty would silently lose its own."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{name}: expected a first derivative only, got a backward with create_graph=True "
                           "(double backward is not supported)")
