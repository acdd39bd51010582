"""The RL outputs for PyTorch (vpce/rl.h): each token's log-probability of its sampled token
and the policy's entropy, both differentiable, on vocab-parallel logits: one all-gather per
forward, none in the backward, the lse and E_p[z] (16 bytes a token) kept between them. An
autograd.Function (PyTorch < 2.4, and the in-place gradient) and, on PyTorch >= 2.4, the
custom ops vpce::rl_forward / vpce::rl_backward (torch.compile traces them whole)."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import _vpce
from ._torch_arguments import (_LOGITS_DTYPES, _TARGET_DTYPES, _WIDENED_TARGET_DTYPES, _as_rows, _as_targets,
                               _check_inplace, _check_logits, _check_op_tensors, _first_derivative_only, _real,
                               _reverse_mode_only)
from ._torch_compile import _CUSTOM_OPS, _compiling
from ._torch_function import _increment_version, _new_gradient, _with_group
from ._torch_groups import _group
from ._torch_ops import _decode_options, _encode_options, _fits_op, _group_key, _keyed_group, _without_data

_RL_OPTION_NAMES = ("ignore_index", "logit_scale", "softcap", "valid_vocab_size", "num_threads")


def _rl_options(temperature, options, function="log_probs_and_entropy", names=_RL_OPTION_NAMES):
    """vpce.RlOptions from a scalar temperature (None: per-token ones are given) and the
    keyword options, of which `function` takes `names`; errors name the function and the
    option."""
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"{function}: unexpected options {unknown}; expected some of {list(names)}")
    result = _vpce.RlOptions()
    if temperature is not None:
        result.temperature = temperature
    for name, value in options.items():
        setattr(result, name, value)
    return result


def _token_shape_problem(shape, target_shape):
    """None where per-token values (temperatures, an objective's weights) of `shape` broadcast
    to the target's under vpce's rule: one per token, or fewer dimensions aligned with the
    target's first ones (padded with 1 at the end: one per row of [b, s] targets, as verl's
    per-sequence temperatures or GRPO's per-sequence advantages; a 0-d tensor for all), the
    opposite of PyTorch's broadcasting, which aligns the last ones (so [b] for [b, b] targets
    is one per row, whatever s happens to be); else what is wrong, for the message."""
    shape, target_shape = tuple(shape), tuple(target_shape)
    extra = len(target_shape) - len(shape)
    leading = shape + (1,) * max(extra, 0)
    if extra < 0 or not all(a in (1, b) for a, b in zip(leading, target_shape)):
        rows = target_shape[:1]
        return (f"expected one per token {target_shape}, or fewer dimensions aligned with the target's first ones "
                f"(one per sequence {rows} or {rows + (1,) * (len(target_shape) - 1)}; a 0-d tensor for all; "
                f"not PyTorch's broadcasting, which aligns the last ones), got {shape}")
    return None


def _per_token_values(values, target, name):
    """A tensor of per-token values (the temperatures, an objective's weights) as float32
    contiguous of the target's shape: on the target's device, floating point, not requiring
    grad (no gradient flows to it: rather than a gradient of None, silently), broadcast by
    _token_shape_problem's rule; else an error naming it."""
    if values.device != target.device:
        raise ValueError(f"{name}.device: expected the target's device {target.device}, got {values.device}")
    if not values.is_floating_point():
        raise TypeError(f"{name}.dtype: expected a floating-point tensor, got {values.dtype}")
    if values.requires_grad:
        raise ValueError(f"{name}: expected a tensor that does not require grad (no gradient flows to it: detach "
                         "it), got one that requires grad")
    return _broadcast_per_token(values, target, name)


def _broadcast_per_token(values, target, name):
    """Per-token values (a temperature or weight tensor) as float32 contiguous of the target's
    shape, by _token_shape_problem's rule; else ValueError naming them."""
    problem = _token_shape_problem(values.shape, target.shape)
    if problem is not None:
        raise ValueError(f"{name}.shape: {problem}")
    lost = _lost_in_float32(values)
    if lost is not None:  # (the error would name the rounding, 0 or inf, not the value given)
        raise ValueError(f"{name}: expected values that float32 holds (vpce computes in float32), got {lost!r}")
    v = values.to(torch.float32)
    return v.reshape(tuple(v.shape) + (1,) * (target.dim() - v.dim())).expand(target.shape).contiguous()


def _lost_in_float32(values):
    """The first of a float64 tensor's values that float32 does not hold (a finite one that
    overflows, a nonzero one that underflows to 0), or None. A branch on the values: eagerly,
    on values that exist; traced or fake, None (the library's own check names the rounding)."""
    if values.dtype != torch.float64 or _compiling() or _without_data(values):
        return None
    rounded = values.to(torch.float32)
    lost = (torch.isfinite(values) & torch.isinf(rounded)) | ((values != 0) & (rounded == 0))
    return values[lost].flatten()[0].item() if lost.any() else None


def _op_takes_temperature(temperature, target):
    """Whether the custom ops take this temperature: a number, or a floating-point tensor on
    the target's device that broadcasts to it (else the autograd.Function, whose checks
    raise inside the collective's scaffolding, alike on every rank)."""
    if isinstance(temperature, torch.Tensor):
        return (isinstance(target, torch.Tensor) and temperature.device == target.device
                and temperature.is_floating_point() and not temperature.requires_grad
                and _token_shape_problem(temperature.shape, target.shape) is None
                and _lost_in_float32(temperature) is None)
    return isinstance(temperature, (float, int)) and not isinstance(temperature, bool) and _float32_holds(temperature)


_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103  # the midpoint above float32's largest value: rounds to inf
_FLOAT32_UNDERFLOW = 2.0**-150  # half float32's smallest subnormal: rounds to 0


def _float32_holds(value):
    """Whether a number keeps its magnitude in float32 (rounded to nearest even): not a finite
    one that overflows, nor a nonzero one that underflows to 0 (NaN and inf are the checks' to
    refuse). Plain arithmetic, so that torch.compile traces it without a break."""
    try:
        magnitude = abs(float(value))
    except OverflowError:  # an integer beyond float64
        return False
    return not ((math.isfinite(magnitude) and magnitude >= _FLOAT32_OVERFLOW) or 0 < magnitude <= _FLOAT32_UNDERFLOW)


def _op_temperature_arguments(temperature, target):
    """The custom ops' (temperatures, scalar) for a temperature _op_takes_temperature takes: a
    tensor as (float32 of the target's shape, 1.0), a number as (None, T)."""
    if isinstance(temperature, torch.Tensor):
        return _broadcast_per_token(temperature, target, "temperature"), 1.0
    return None, float(temperature)


def _as_temperatures(temperature, logits, target):
    """(scalar, per-token tensor): a number gives (T, None); a tensor one per token (or
    per sequence: _token_shape_problem's rule) gives (None, float32 contiguous of the target's shape). The
    temperature takes no gradient: a tensor that requires one is refused."""
    if not isinstance(temperature, torch.Tensor):
        value = _real(temperature, "temperature")
        if not _float32_holds(value):
            raise ValueError(f"temperature: expected a value that float32 holds (vpce computes in float32), got "
                             f"{value!r}")
        return value, None
    return None, _per_token_values(temperature, target, "temperature")


def _policy(collective, rank, size, logits, target, temperature, options, inplace):
    """Checks, then vpce's forward: (log_prob, entropy, x, y, lse, mean_logit, temperatures,
    shard, options)."""
    _check_logits(logits)
    if isinstance(target, torch.Tensor) and tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target.shape: expected the logits' leading shape {tuple(logits.shape[:-1])} (one sampled "
                         f"token per row), got {tuple(target.shape)}")
    y = _as_targets(target, logits)
    scalar, t = _as_temperatures(temperature, logits, y)
    opts = _rl_options(scalar, options)
    if inplace:
        _check_inplace(logits)
    x = _as_rows(logits)
    local = x.shape[-1]
    shard = (rank * local, (rank + 1) * local, size * local)
    log_prob = torch.empty(y.shape, dtype=torch.float32, device=x.device)
    entropy = torch.empty(y.shape, dtype=torch.float32, device=x.device)
    lse = torch.empty(y.shape, dtype=torch.float64, device=x.device)
    mean = torch.empty(y.shape, dtype=torch.float64, device=x.device)
    _vpce.rl_forward(x, y, *shard, opts, log_prob, entropy, lse, mean, t, rank=rank, size=size,
                     all_gather=collective)
    return log_prob, entropy, x, y, lse, mean, t, shard, scalar


def _policy_gradient(x, y, lse, mean, grad_log_prob, grad_entropy, t, shard, scalar, options, inplace):
    """The gradient of g_lp log_prob + g_H entropy for the logits (no collective): over x when
    in place, else new. A None upstream is zero (the entropy's term is then skipped)."""
    opts = _rl_options(scalar, options)
    g_lp = None if grad_log_prob is None else grad_log_prob.to(torch.float32).contiguous()
    g_h = None if grad_entropy is None else grad_entropy.to(torch.float32).contiguous()
    grad = x if inplace else _new_gradient(x)
    _vpce.rl_backward(x, y, lse, mean, g_lp, g_h, *shard, opts, grad, t)
    return grad


class _VpceLogProbs(torch.autograd.Function):
    """log_probs_and_entropy as an autograd.Function: (log_prob, entropy)."""

    @staticmethod
    def forward(ctx, logits, target, temperature, tp_group, inplace, options):
        def body(collective, rank, size):
            return _policy(collective, rank, size, logits, target, temperature, options, inplace)

        log_prob, entropy, x, y, lse, mean, t, shard, scalar = _with_group(tp_group, logits, body)
        ctx.save_for_backward(x, y, lse, mean, t)
        # plain values, not bound objects
        ctx.shard, ctx.scalar, ctx.options, ctx.inplace, ctx.input_dtype = shard, scalar, options, inplace, logits.dtype
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        _first_derivative_only("log_probs_and_entropy")
        x, y, lse, mean, t = ctx.saved_tensors
        grad = _policy_gradient(x, y, lse, mean, grad_log_prob, grad_entropy, t, ctx.shard, ctx.scalar, ctx.options,
                                ctx.inplace)
        if ctx.inplace:
            _increment_version(x)
        if grad.dtype != ctx.input_dtype:
            grad = grad.to(ctx.input_dtype)
        return grad, None, None, None, None, None


def _op_shard(logits, group_key):
    _, rank, size = _group(_keyed_group(group_key))
    local = logits.shape[-1]
    return rank * local, (rank + 1) * local, size * local


def _op_temperature(temperatures, temperature):
    return temperature if temperatures is None else temperatures


def _check_op_forward(logits, target, real=True):
    _check_op_tensors("vpce::rl_forward", "logits", logits,
                      (("logits", logits, _LOGITS_DTYPES),
                       ("target", target, _TARGET_DTYPES + _WIDENED_TARGET_DTYPES)), real)


if _CUSTOM_OPS:
    from torch import Tensor  # noqa: E402

    @torch.library.custom_op("vpce::rl_forward", mutates_args=())
    def _op_forward(logits: Tensor, target: Tensor, temperatures: Optional[Tensor], temperature: float,
                    group_key: int, options: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """vpce's RL forward: (log_prob, entropy, lse, mean_logit); the one all-gather on the keyed group."""
        _check_op_forward(logits, target)

        def body(collective, rank, size):
            return _policy(collective, rank, size, logits, target, _op_temperature(temperatures, temperature),
                           _decode_options(options), False)

        log_prob, entropy, _, _, lse, mean, _, _, _ = _with_group(_keyed_group(group_key), logits, body)
        return log_prob, entropy, lse, mean

    @_op_forward.register_fake
    def _(logits, target, temperatures, temperature, group_key, options):
        _check_op_forward(logits, target, real=False)
        shape = logits.shape[:-1]
        return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.float32),
                logits.new_empty(shape, dtype=torch.float64), logits.new_empty(shape, dtype=torch.float64))

    @torch.library.custom_op("vpce::rl_backward", mutates_args=())
    def _op_backward(logits: Tensor, target: Tensor, lse: Tensor, mean_logit: Tensor,
                     grad_log_prob: Optional[Tensor], grad_entropy: Optional[Tensor], temperatures: Optional[Tensor],
                     temperature: float, group_key: int, options: str) -> Tensor:
        """vpce's RL backward: the logits' gradient, a new contiguous tensor in their dtype; no collective."""
        x = _as_rows(logits)
        y = _as_targets(target, logits)
        scalar, t = _as_temperatures(_op_temperature(temperatures, temperature), logits, y)
        grad = _policy_gradient(x, y, lse, mean_logit, grad_log_prob, grad_entropy, t, _op_shard(logits, group_key),
                                scalar, _decode_options(options), False)
        if grad.dtype != logits.dtype:
            grad = grad.to(logits.dtype)
        if grad.shape != logits.shape or not grad.is_contiguous():
            grad = grad.contiguous().view(logits.shape)
        return grad

    @_op_backward.register_fake
    def _(logits, target, lse, mean_logit, grad_log_prob, grad_entropy, temperatures, temperature, group_key,
          options):
        return logits.new_empty(logits.shape)

    def _setup_context(ctx, inputs, output):
        logits, target, temperatures, temperature, group_key, options = inputs
        ctx.save_for_backward(logits, target, output[2], output[3], temperatures)
        ctx.arguments = (temperature, group_key, options)

    def _op_autograd(ctx, grad_log_prob, grad_entropy, grad_lse, grad_mean):
        del grad_lse, grad_mean  # kept for the backward: no gradient flows through them
        _first_derivative_only("log_probs_and_entropy")
        logits, target, lse, mean, temperatures = ctx.saved_tensors
        grad = torch.ops.vpce.rl_backward(logits, target, lse, mean, grad_log_prob, grad_entropy, temperatures,
                                          *ctx.arguments)
        return grad, None, None, None, None, None

    torch.library.register_autograd("vpce::rl_forward", _op_autograd, setup_context=_setup_context)


def _fits_rl_op(logits, target, temperature, options):
    """Whether the custom op takes these arguments (the loss's op's rule, a target of the
    logits' leading shape, a temperature _op_takes_temperature takes); else the
    autograd.Function, whose checks raise."""
    if not _fits_op(logits, target, 0.0, options) or tuple(target.shape) != tuple(logits.shape[:-1]):
        return False
    return _op_takes_temperature(temperature, target)


@_reverse_mode_only("logits")
def log_probs_and_entropy(logits, target, temperature=1.0, tp_group=None, inplace_backward=False, **options):
    """(log_prob, entropy) of each token, float32 of the target's shape, differentiable.

    logits: [..., V/R] (this rank's columns; fp32, bf16, fp16 or fp64), target: the sampled
    token of each row (int), temperature: a number, or a tensor of one per token (or
    one per sequence: fewer dimensions align with the target's first ones). With z = transform(logits) / T over the
    whole vocabulary: log_prob = log softmax(z)[target], entropy = -sum p log p. One
    all-gather on tp_group per call, none in the backward; a target equal to ignore_index
    (default -100) gives 0 and no gradient. options: ignore_index, logit_scale, softcap,
    valid_vocab_size, num_threads. inplace_backward=True writes the gradient over the logits.
    """
    compiling = _CUSTOM_OPS and (_compiling() or _without_data(logits))
    if _CUSTOM_OPS and (compiling or not inplace_backward) and _fits_rl_op(logits, target, temperature, options):
        temperatures, scalar = _op_temperature_arguments(temperature, target)
        log_prob, entropy, _, _ = torch.ops.vpce.rl_forward(logits, target, temperatures, scalar,
                                                             _group_key(tp_group), _encode_options(options))
        return log_prob, entropy
    return _VpceLogProbs.apply(logits, target, temperature, tp_group, inplace_backward, options)


def _eager(function):
    """Runs outside torch.compile's graphs (a graph break) where PyTorch can say so."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(function) if disable is not None else function


@_eager
def sum_pi_squared(logits, temperature=1.0, tp_group=None, **options):
    """sum_v p_v^2 of softmax(transform(logits) / T) per row, float32 of the logits' leading
    shape, over the whole vocabulary (verl's vocab_parallel_sum_pi_squared, for its
    optimal-baseline estimators): one all-gather on tp_group, no gradient (a detached
    tensor; eager, a graph break under torch.compile). temperature and options as
    log_probs_and_entropy's."""
    with torch.no_grad():
        tokens = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)

        def body(collective, rank, size):
            _check_logits(logits)
            scalar, t = _as_temperatures(temperature, logits, tokens)
            # There are no targets: the rows' dummy 0s must never be ignore_index (with 0 every
            # row read as ignored), whatever ignore_index a caller's shared options carry.
            opts = _rl_options(scalar, {**options, "ignore_index": -1}, "sum_pi_squared")
            x = _as_rows(logits)
            local = x.shape[-1]
            squares = torch.empty(tokens.shape, dtype=torch.float32, device=x.device)
            _vpce.rl_forward(x, tokens, rank * local, (rank + 1) * local, size * local, opts, None, None, None, None,
                             t, rank=rank, size=size, all_gather=collective, sum_p_squared=squares)
            return squares

        return _with_group(tp_group, logits, body)
