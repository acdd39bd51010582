"""The RL outputs in the fused head for PyTorch (vpce/rl.h's linear_forward / linear_backward,
and linear_forward_backward): log-probabilities and entropy of hidden @ weight.T + bias
without the logits, on the head's scaffolding (_torch_head: groups, sequence parallelism,
main_grad, the hidden gradient's reduction): autograd.Functions and, on PyTorch >= 2.4, the
custom ops vpce::rl_linear_forward / vpce::rl_linear_backward (recompute mode) and
vpce::rl_linear_chunked (chunked mode)."""
from __future__ import annotations

import torch

from . import _vpce
from ._torch_arguments import _first_derivative_only, _reverse_mode_only
from ._torch_compile import _CUSTOM_OPS, _compiling
from ._torch_head import (_HEAD_OPTION_NAMES, _Arguments, _check_head_op, _chunked_backward, _fits_head_op,
                          _head_backward_with, _head_chunked_with, _head_forward_with, _keep_chunked, _needs,
                          _nothing, _present, _register_chunked_autograd)
from ._torch_ops import _decode_options, _encode_options, _group_key, _keyed_group
from ._torch_rl import (_RL_OPTION_NAMES, _as_temperatures, _op_takes_temperature, _op_temperature_arguments,
                        _per_token_values, _rl_options)

_HEAD_RL_OPTION_NAMES = set(_RL_OPTION_NAMES) | set(_HEAD_OPTION_NAMES) | {"gradient_accumulation_fusion",
                                                                             "vocab_range"}


def _check_options(options, function):
    unknown = sorted(set(options) - _HEAD_RL_OPTION_NAMES)
    if unknown:
        raise TypeError(f"{function}: unexpected options {unknown}; expected some of {sorted(_HEAD_RL_OPTION_NAMES)}")


def _temperature_value(temperatures, temperature):
    return temperature if temperatures is None else temperatures


def _policy_head_forward(hidden, weight, bias, target, temperature, tp_group, sequence_parallel, options,
                         need_hidden, need_weight):
    """(log_prob, entropy, lse, mean_logit, per-token temperatures or None). Argument errors
    are raised inside the scaffolding, where every rank of the group raises them alike."""

    def kernel(args, y, total, w, b, shard, collective, rank, size):
        scalar, t = _as_temperatures(temperature, total, y)
        opts = _rl_options(scalar, args.loss_options)
        log_prob = torch.empty(y.shape, dtype=torch.float32, device=total.device)
        entropy = torch.empty(y.shape, dtype=torch.float32, device=total.device)
        lse = torch.empty(y.shape, dtype=torch.float64, device=total.device)
        mean = torch.empty(y.shape, dtype=torch.float64, device=total.device)
        _vpce.rl_linear_forward(total, w, _present(b), y, *shard, opts, args.head, log_prob, entropy, lse, mean, t,
                                rank=rank, size=size, all_gather=collective)
        return log_prob, entropy, lse, mean, t

    outputs, _ = _head_forward_with(kernel, hidden, weight, bias, target, 0.0, tp_group, sequence_parallel, options,
                                    need_hidden, need_weight,
                                    check=lambda: _check_options(options, "linear_log_probs_and_entropy"))
    return outputs


def _policy_head_backward(hidden, weight, bias, target, lse, mean, grad_log_prob, grad_entropy, temperature, tp_group,
                          sequence_parallel, options, needs):
    """(grad_hidden, grad_weight, grad_bias), each None where needs[i] is false."""

    def kernel(args, y, total, w, b, shard, grad_hidden, grad_weight, grad_bias, add_weight):
        scalar, t = _as_temperatures(temperature, total, y)
        opts = _rl_options(scalar, args.loss_options)
        g_lp = None if grad_log_prob is None else grad_log_prob.to(torch.float32).contiguous()
        g_h = None if grad_entropy is None else grad_entropy.to(torch.float32).contiguous()
        _vpce.rl_linear_backward(total, w, _present(b), y, lse, mean, g_lp, g_h, *shard, opts, args.head, grad_hidden,
                                 grad_weight, None if _present(b) is None else grad_bias,
                                 accumulate_weight=add_weight, temperatures=t)

    return _head_backward_with(kernel, hidden, weight, bias, target, 0.0, tp_group, sequence_parallel, options, needs)


def _token_weights(weights, target, name):
    """An objective's weights: None, or a tensor of one per token (or per sequence: the
    temperature's rule, _per_token_values) as float32 contiguous of the target's shape."""
    if weights is None:
        return None
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor of one weight per token or None, got {type(weights).__name__}")
    return _per_token_values(weights, target, name)


def _policy_head_chunked(hidden, weight, bias, target, log_prob_weights, entropy_weights, temperature, tp_group,
                         sequence_parallel, options, needs):
    """The chunked mode: (objective, log_prob, entropy, grad_hidden, grad_weight, grad_bias),
    objective = sum(log_prob_weights * log_prob + entropy_weights * entropy) in float32, the
    gradients its own (float32, None where not needed), the hidden one summed over the group.
    Argument errors are raised inside the scaffolding, where every rank of the group raises them alike."""

    def kernel(args, y, total, w, b, shard, grad_hidden, grad_weight, grad_bias, collective, rank, size):
        lp_weights = _token_weights(log_prob_weights, y, "log_prob_weights")
        h_weights = _token_weights(entropy_weights, y, "entropy_weights")
        scalar, t = _as_temperatures(temperature, total, y)
        opts = _rl_options(scalar, args.loss_options)
        log_prob = torch.empty(y.shape, dtype=torch.float32, device=total.device)
        entropy = torch.empty(y.shape, dtype=torch.float32, device=total.device)
        _vpce.rl_linear_forward_backward(total, w, _present(b), y, lp_weights, h_weights, *shard, opts, args.head,
                                         log_prob, entropy, grad_hidden, grad_weight, grad_bias, temperatures=t,
                                         rank=rank, size=size, all_gather=collective)
        objective = torch.zeros((), dtype=torch.float64, device=total.device)
        for weights, output in ((lp_weights, log_prob), (h_weights, entropy)):
            if weights is not None:
                objective += (weights.double() * output.double()).sum()
        return objective.float(), log_prob, entropy

    (objective, log_prob, entropy), grads = _head_chunked_with(kernel, hidden, weight, bias, target, 0.0, tp_group,
                                                               sequence_parallel, options, needs,
                                                               check=lambda: _check_options(
                                                                   options, "linear_policy_objective"))
    return (objective, log_prob, entropy, *grads)


class _LinearPolicyObjective(torch.autograd.Function):
    """linear_policy_objective as an autograd.Function: (objective, log_prob, entropy), the
    gradients computed in the forward and scaled by the objective's upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, log_prob_weights, entropy_weights, temperature, tp_group,
                sequence_parallel, options):
        needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        objective, log_prob, entropy, *grads = _policy_head_chunked(
            hidden, weight, bias, target, log_prob_weights, entropy_weights, temperature, tp_group, sequence_parallel,
            options, needs)
        _keep_chunked(ctx, grads, hidden, weight, bias, needs)
        ctx.options = options
        ctx.mark_non_differentiable(log_prob, entropy)
        return objective, log_prob, entropy

    @staticmethod
    def backward(ctx, grad_objective, grad_log_prob, grad_entropy):
        del grad_log_prob, grad_entropy  # no gradient flows through them (not differentiable)
        _first_derivative_only("linear_policy_objective")
        grads = _chunked_backward(ctx, grad_objective, _Arguments(0.0, ctx.options), "linear_policy_objective",
                                  "use linear_log_probs_and_entropy to backward more than once")
        return (*grads, None, None, None, None, None, None, None)


class _LinearLogProbs(torch.autograd.Function):
    """linear_log_probs_and_entropy as an autograd.Function: (log_prob, entropy)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, temperature, tp_group, sequence_parallel, options):
        needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        log_prob, entropy, lse, mean, t = _policy_head_forward(hidden, weight, bias, target, temperature, tp_group,
                                                               sequence_parallel, options, needs[0], needs[1])
        ctx.save_for_backward(hidden, weight, bias, target, lse, mean, t)
        ctx.arguments = (None if isinstance(temperature, torch.Tensor) else temperature, tp_group, sequence_parallel,
                         options)
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        _first_derivative_only("linear_log_probs_and_entropy")
        hidden, weight, bias, target, lse, mean, t = ctx.saved_tensors
        scalar, tp_group, sequence_parallel, options = ctx.arguments
        needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        grads = _policy_head_backward(hidden, weight, bias, target, lse, mean, grad_log_prob, grad_entropy,
                                      _temperature_value(t, scalar), tp_group, sequence_parallel, options, needs)
        return (*grads, None, None, None, None, None)


if _CUSTOM_OPS:
    from typing import Optional, Tuple  # noqa: E402

    from torch import Tensor  # noqa: E402

    @torch.library.custom_op("vpce::rl_linear_forward", mutates_args=())
    def _op_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                    temperatures: Optional[Tensor], temperature: float, group_key: int, sequence_parallel: bool,
                    options: str, need_hidden: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The RL outputs in the head (recompute): (log_prob, entropy, lse, mean_logit)."""
        _check_head_op("rl_linear_forward", hidden, weight, bias, target)
        log_prob, entropy, lse, mean, _ = _policy_head_forward(
            hidden, weight, bias, target, _temperature_value(temperatures, temperature), _keyed_group(group_key),
            sequence_parallel, _decode_options(options), need_hidden, False)
        return log_prob, entropy, lse, mean

    @_op_forward.register_fake
    def _(hidden, weight, bias, target, temperatures, temperature, group_key, sequence_parallel, options, need_hidden):
        _check_head_op("rl_linear_forward", hidden, weight, bias, target, real=False)
        shape = tuple(target.shape)
        return (hidden.new_empty(shape, dtype=torch.float32), hidden.new_empty(shape, dtype=torch.float32),
                hidden.new_empty(shape, dtype=torch.float64), hidden.new_empty(shape, dtype=torch.float64))

    @torch.library.custom_op("vpce::rl_linear_backward", mutates_args=())
    def _op_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor,
                     mean_logit: Tensor, grad_log_prob: Optional[Tensor], grad_entropy: Optional[Tensor],
                     temperatures: Optional[Tensor], temperature: float, group_key: int, sequence_parallel: bool,
                     options: str, need_hidden: bool, need_weight: bool,
                     need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """The RL outputs' head backward: (grad_hidden, grad_weight, grad_bias), empty where not needed."""
        _check_head_op("rl_linear_backward", hidden, weight, bias, target, lse)
        grads = _policy_head_backward(hidden, weight, bias, target, lse, mean_logit, grad_log_prob, grad_entropy,
                                      _temperature_value(temperatures, temperature), _keyed_group(group_key),
                                      sequence_parallel, _decode_options(options),
                                      (need_hidden, need_weight, need_bias))
        return tuple(_nothing(hidden) if g is None else g for g in grads)

    @_op_backward.register_fake
    def _(hidden, weight, bias, target, lse, mean_logit, grad_log_prob, grad_entropy, temperatures, temperature,
          group_key, sequence_parallel, options, need_hidden, need_weight, need_bias):
        return (hidden.new_empty(hidden.shape) if need_hidden else _nothing(hidden),
                weight.new_empty(weight.shape) if need_weight else _nothing(hidden),
                bias.new_empty(bias.shape) if need_bias and bias is not None else _nothing(hidden))

    def _setup(ctx, inputs, output):
        hidden, weight, bias, target, temperatures, temperature, group_key, sequence_parallel, options, _ = inputs
        ctx.save_for_backward(hidden, weight, bias, target, output[2], output[3], temperatures)
        ctx.arguments = (temperature, group_key, sequence_parallel, options)

    def _autograd(ctx, grad_log_prob, grad_entropy, grad_lse, grad_mean):
        del grad_lse, grad_mean  # kept for the backward: no gradient flows through them
        _first_derivative_only("linear_log_probs_and_entropy")
        hidden, weight, bias, target, lse, mean, temperatures = ctx.saved_tensors
        need_hidden, need_weight, need_bias = (bool(n) for n in ctx.needs_input_grad[:3])
        need_bias = need_bias and bias is not None
        grad_hidden, grad_weight, grad_bias = torch.ops.vpce.rl_linear_backward(
            hidden, weight, bias, target, lse, mean, grad_log_prob, grad_entropy, temperatures, *ctx.arguments,
            need_hidden, need_weight, need_bias)
        return (grad_hidden if need_hidden else None, grad_weight if need_weight else None,
                grad_bias if need_bias else None, None, None, None, None, None, None, None)

    torch.library.register_autograd("vpce::rl_linear_forward", _autograd, setup_context=_setup)

    @torch.library.custom_op("vpce::rl_linear_chunked", mutates_args=())
    def _op_chunked(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                    log_prob_weights: Optional[Tensor], entropy_weights: Optional[Tensor],
                    temperatures: Optional[Tensor], temperature: float, group_key: int, sequence_parallel: bool,
                    options: str, need_hidden: bool, need_weight: bool,
                    need_bias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The RL outputs in the head (chunked): (objective, log_prob, entropy, grad_hidden,
        grad_weight, grad_bias), the gradients float32 for an upstream gradient of 1 (empty
        where not needed)."""
        _check_head_op("rl_linear_chunked", hidden, weight, bias, target)
        objective, log_prob, entropy, *grads = _policy_head_chunked(
            hidden, weight, bias, target, log_prob_weights, entropy_weights,
            _temperature_value(temperatures, temperature), _keyed_group(group_key), sequence_parallel,
            _decode_options(options), (need_hidden, need_weight, need_bias))
        return (objective, log_prob, entropy, *(_nothing(hidden).float() if g is None else g for g in grads))

    @_op_chunked.register_fake
    def _(hidden, weight, bias, target, log_prob_weights, entropy_weights, temperatures, temperature, group_key,
          sequence_parallel, options, need_hidden, need_weight, need_bias):
        _check_head_op("rl_linear_chunked", hidden, weight, bias, target, real=False)
        f32, shape = torch.float32, tuple(target.shape)
        return (hidden.new_empty((), dtype=f32), hidden.new_empty(shape, dtype=f32), hidden.new_empty(shape, dtype=f32),
                hidden.new_empty(hidden.shape, dtype=f32) if need_hidden else _nothing(hidden).float(),
                weight.new_empty(weight.shape, dtype=f32) if need_weight else _nothing(hidden).float(),
                bias.new_empty(bias.shape, dtype=f32) if need_bias and bias is not None else _nothing(hidden).float())

    _register_chunked_autograd("vpce::rl_linear_chunked", "linear_policy_objective", 3, 11)


@_reverse_mode_only("hidden", "weight", "bias")
def linear_log_probs_and_entropy(hidden, weight, target, temperature=1.0, tp_group=None, *, bias=None,
                                 sequence_parallel=False, **options):
    """(log_prob, entropy) of the output layer's logits hidden @ weight.T + bias without
    building them: float32 of the target's shape, differentiable for hidden, weight and bias.

    hidden, weight, bias, tp_group, sequence_parallel: as linear_cross_entropy's (the hidden
    gradient summed over tp_group in the backward). target: the sampled token of each row.
    temperature: a number, or a tensor of one per token (or per sequence, as log_probs_and_entropy's).
    options: ignore_index, logit_scale, softcap, valid_vocab_size, num_threads, the head's
    token_block, vocab_block, bf16_logit_gradients, round_logits, and
    gradient_accumulation_fusion and vocab_range as linear_cross_entropy's. The head's
    recompute mode: one all-gather in the forward (plus the sequence-parallel one of the
    hidden states), the hidden gradient's reduction in the backward.
    """
    args = (hidden, weight, bias, target, temperature, tp_group, sequence_parallel, options)
    if isinstance(sequence_parallel, bool) and _fits_rl_head_op(hidden, weight, bias, target, temperature, options):
        temperatures, scalar = _op_temperature_arguments(temperature, target)
        log_prob, entropy, _, _ = torch.ops.vpce.rl_linear_forward(
            hidden, weight, bias, target, temperatures, scalar,
            _group_key(tp_group), sequence_parallel, _encode_options(options), _needs(hidden, weight, bias)[0])
        return log_prob, entropy
    return _LinearLogProbs.apply(*args)


def _fits_rl_head_op(hidden, weight, bias, target, temperature, options):
    """Whether the head's RL custom ops take these arguments (else the autograd.Functions,
    whose checks raise the same error on every rank)."""
    return (_CUSTOM_OPS and _op_takes_temperature(temperature, target)
            and _fits_head_op(hidden, weight, bias, target, 0.0, options))


@_reverse_mode_only("hidden", "weight", "bias")
def linear_policy_objective(hidden, weight, target, log_prob_weights, entropy_weights=None, temperature=1.0,
                            tp_group=None, *, bias=None, sequence_parallel=False, **options):
    """(objective, log_prob, entropy) of the output layer's logits hidden @ weight.T + bias
    without building them, for a step whose per-token upstream gradients are known before
    the forward: objective = sum_i (log_prob_weights_i log_prob_i + entropy_weights_i
    entropy_i), a 0-d float32 tensor differentiable for hidden, weight and bias, its
    gradients computed inside this forward by the head's chunked mode (three GEMMs instead
    of the recompute mode's four); log_prob and entropy float32 of the target's shape,
    without gradient (for logging, ratios, KL metrics).

    The on-policy step of GRPO or REINFORCE (one update per rollout: the importance ratio is
    1, so d loss / d log_prob_i = -A_i m_i / sum(m)) is objective with log_prob_weights =
    -advantages * mask / mask.sum() and entropy_weights = -coef * mask / mask.sum(); a
    clipped ratio of a later PPO epoch needs log_prob first (linear_log_probs_and_entropy).

    log_prob_weights, entropy_weights: tensors of one per token or per sequence (the temperature's rule;
    None: zero), the
    same on every rank of tp_group (hashed and compared: ranks that differ all raise).
    hidden, weight, bias, target, temperature, tp_group, sequence_parallel and options: as
    linear_log_probs_and_entropy's, and the head's chunk_tokens. One all-gather per chunk of
    tokens, then the hidden gradient's reduction, all in this call; one backward per call.
    """
    # Eager calls take the autograd.Function, which scales the gradients in place (the op's
    # backward cannot change its outputs: a copy of each gradient).
    weights_fit = all(w is None or (isinstance(w, torch.Tensor) and not w.requires_grad)
                      for w in (log_prob_weights, entropy_weights))
    if (_compiling() and weights_fit and isinstance(sequence_parallel, bool)
            and _fits_rl_head_op(hidden, weight, bias, target, temperature, options)):
        temperatures, scalar = _op_temperature_arguments(temperature, target)
        objective, log_prob, entropy, *_ = torch.ops.vpce.rl_linear_chunked(
            hidden, weight, bias, target, log_prob_weights, entropy_weights, temperatures, scalar,
            _group_key(tp_group), sequence_parallel, _encode_options(options), *_needs(hidden, weight, bias))
        return objective, log_prob.detach(), entropy.detach()
    return _LinearPolicyObjective.apply(hidden, weight, bias, target, log_prob_weights, entropy_weights, temperature,
                                        tp_group, sequence_parallel, options)
