"""vpce.megatron: megatron-core's GPTModel with its output layer and loss fused by vpce.

    import vpce.megatron
    model = GPTModel(config, ...)                       # as usual
    vpce.megatron.fuse_output_layer(model)              # one call, before training

From then on a forward given `labels` computes the output layer and the per-token loss with
`vpce.torch.linear_cross_entropy`, without building the logits: the hidden states and this
rank's output-weight rows go straight to vpce's fused head (tensor parallelism, sequence
parallelism, tied embeddings, gradient-accumulation fusion into `main_grad`, the layer's bias,
multi-token prediction, the last pipeline stage). A forward without labels, and inference,
keep Megatron's own path and get the logits. Nothing of Megatron's code is edited: the model
instance's `forward`, its `compute_language_model_loss` and its output layer's `forward` are
wrapped (the parameters, their names and the checkpoints are unchanged), and
`unfuse_output_layer(model)` takes the wrappers off.

Modes (keyword `mode`):
- "recompute" (default): the per-token loss [b, s], as GPTModel returns it; the backward
  recomputes the logit tiles (vpce/head.h).
- "chunked": the gradients are computed in the forward, chunk by chunk, for the loss summed
  over the tokens that `loss_mask` keeps (the forward must be given `loss_mask`). The model
  still returns a [b, s] tensor, the first kept token holding the kept tokens' summed loss and
  every other token 0 (the per-token values are not computed), so that
  `(loss * loss_mask).sum()`, as Megatron's loss functions take it (a 0/1 mask), is that sum
  exactly (it adds zeros) and its gradient the exact gradient; a loss function that weighs
  tokens differently, or reads per-token losses, must use "recompute".

Label smoothing (keywords, as linear_cross_entropy takes them): `label_smoothing=a` is vpce's
exact smoothing over the whole vocabulary, the same loss on every rank; with
`megatron_legacy_label_smoothing=True` it is Megatron's vocab_parallel_cross_entropy(...,
label_smoothing=a), which smooths over each rank's own rows (the losses differ by rank).

Precision: by default the logits are the fp32 products of the operands (bf16 operands too),
the more exact; Megatron's bf16 output layer rounds them to bf16 before its loss, so a bf16
run's losses then differ from Megatron's by that rounding. `round_logits=True` rounds them as
that layer does (round(round(h W^T) + b)), and `bf16_logit_gradients=True` rounds the logit
gradients to bf16 as its backward does: together they reproduce a bf16 Megatron run (the
step's loss within one fp32 ulp in tests/test_megatron_gpt.py).

RL outputs: `vpce.megatron.log_probs_and_entropy(model, *forward_args, labels=tokens,
temperature=t, **forward_kwargs)` runs the fused model's forward and returns the
log-probabilities of `labels` and the policy's entropy, each [b, s] float32 and differentiable,
from the hidden states through vpce's head (vpce.torch.linear_log_probs_and_entropy) without
ever building the logits: what a Megatron-based RL trainer (verl, NeMo-RL) computes from the
logits. `temperature` a number or a tensor of one per token [b, s] or per sequence [b].

What it refuses, naming it (rather than computing something else): an output layer that
gathers its output (`gather_output` or `runtime_gather_output=True`), deferred embedding
weight-gradients (`defer_embedding_wgrad_compute`), `disable_grad_reduce` or
`explicit_expert_comm` output layers, and the config logger (it would log the logits).
"""
from __future__ import annotations

import contextvars
import inspect

import torch

from . import torch as vt
from ._torch_arguments import _OPTION_NAMES
from ._torch_head import _HEAD_OPTION_NAMES
from ._torch_rl import _token_shape_problem

__all__ = ["fuse_output_layer", "unfuse_output_layer", "is_fused", "log_probs_and_entropy", "policy_objective"]

_MODES = ("recompute", "chunked")
# Set while a fused model's forward runs with labels: (the fused model, its loss_mask).
_ACTIVE = contextvars.ContextVar("vpce_megatron_active", default=None)
# Set while log_probs_and_entropy or policy_objective runs a fused model's forward: (the model,
# its _PolicyRequest).
_POLICY = contextvars.ContextVar("vpce_megatron_policy", default=None)
# fuse_output_layer's options: linear_cross_entropy's but those it sets itself.
_FROM_THE_LAYER = ("tp_group", "bias", "sequence_parallel", "gradient_accumulation_fusion")
_FUSE_OPTIONS = (("label_smoothing", "megatron_legacy_label_smoothing", "vocab_range") + _OPTION_NAMES
                 + _HEAD_OPTION_NAMES)
# The options of fuse_output_layer that the RL outputs take too.
_POLICY_OPTIONS = ("logit_scale", "softcap", "valid_vocab_size", "num_threads", "token_block", "vocab_block",
                   "chunk_tokens", "bf16_logit_gradients", "round_logits", "ignore_index")


class _PolicyRequest:
    """What log_probs_and_entropy (or policy_objective, with the objective's weights) asks of
    the fused forward: the temperature; the entropy (and the objective's log-probabilities)
    come back in it (the forward returns the log-probabilities or the objective, as it
    returns the loss)."""

    def __init__(self, temperature, weights=None):
        self.temperature = temperature
        self.weights = weights  # (log_prob_weights, entropy_weights) [b, s] for policy_objective
        self.log_prob = None
        self.entropy = None


class _Deferred:
    """What the fused output layer returns instead of logits: its operands, for
    compute_language_model_loss to hand to vpce's head."""

    def __init__(self, layer, hidden, weight):
        self.layer, self.hidden, self.weight = layer, hidden, weight


def _unwrap(model):
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module: their .module)."""
    seen = model
    while not hasattr(seen, "compute_language_model_loss") and hasattr(seen, "module"):
        seen = seen.module
    if not (hasattr(seen, "compute_language_model_loss") and hasattr(seen, "forward")):
        raise TypeError(f"vpce.megatron: expected a megatron-core GPTModel (or a wrapper of one), got "
                        f"{type(model).__name__}")
    return seen


def _check_layer(model, layer, mode):
    config = model.config
    refused = []
    if getattr(layer, "gather_output", False):
        refused.append("an output layer with gather_output=True")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        refused.append("defer_embedding_wgrad_compute")
    if getattr(layer, "disable_grad_reduce", False):
        refused.append("an output layer with disable_grad_reduce")
    if getattr(layer, "explicit_expert_comm", False):
        refused.append("an output layer with explicit_expert_comm")
    if getattr(config, "config_logger_dir", ""):
        refused.append("the config logger (config_logger_dir: it logs the logits)")
    if mode == "chunked" and getattr(config, "mtp_num_layers", None):
        refused.append("the chunked mode with multi-token prediction (its heads' masks roll with their labels: use "
                       "mode='recompute')")
    if refused:
        raise ValueError("vpce.megatron.fuse_output_layer: not supported: " + ", ".join(refused))


def fuse_output_layer(model, *, mode="recompute", **options):
    """Makes `model` (a megatron-core GPTModel, a wrapper of one, or a list of them: the
    virtual pipeline's chunks) compute its output layer and loss with
    vpce.torch.linear_cross_entropy whenever its forward is given labels. `mode`: "recompute"
    or "chunked" (see the module's documentation); `options`: linear_cross_entropy's keyword
    options (label_smoothing, megatron_legacy_label_smoothing, round_logits,
    bf16_logit_gradients, token_block, vocab_block, chunk_tokens, num_threads, logit_scale,
    softcap, z_loss_weight, ...; not reduction, which the mode sets). Returns
    `model`. A model on a stage without the output layer is left as it is."""
    if isinstance(model, (list, tuple)):
        for chunk in model:
            fuse_output_layer(chunk, mode=mode, **options)
        return model
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {list(_MODES)}, got {mode!r}")
    if "reduction" in options:
        raise ValueError("reduction: set by the mode (recompute: per token, chunked: the kept tokens' sum), "
                         f"got reduction={options['reduction']!r}")
    taken = sorted(set(options) & set(_FROM_THE_LAYER))
    if taken:
        raise ValueError(f"vpce.megatron.fuse_output_layer: options {taken}: set from the output layer and its "
                         "model (tp_group, bias, sequence_parallel, gradient_accumulation_fusion), not given")
    unknown = sorted(set(options) - set(_FUSE_OPTIONS))
    if unknown:
        raise TypeError(f"vpce.megatron.fuse_output_layer: unexpected options {unknown}; expected some of "
                        f"{sorted(_FUSE_OPTIONS)}")
    gpt = _unwrap(model)
    if is_fused(gpt):
        raise ValueError("vpce.megatron.fuse_output_layer: the model is fused already")
    if not getattr(gpt, "post_process", True) or getattr(gpt, "output_layer", None) is None:
        return model  # a pipeline stage without the output layer
    layer = gpt.output_layer
    _check_layer(gpt, layer, mode)
    _wrap(gpt, layer, mode, dict(options))
    return model


def is_fused(model):
    """Whether fuse_output_layer has been applied to `model` (or the GPTModel inside it)."""
    return "_vpce_fused" in vars(_unwrap(model))


def unfuse_output_layer(model):
    """Takes fuse_output_layer's wrappers off `model` (a list: each chunk). Returns `model`."""
    if isinstance(model, (list, tuple)):
        for chunk in model:
            unfuse_output_layer(chunk)
        return model
    gpt = _unwrap(model)
    state = vars(gpt).pop("_vpce_fused", None)
    if state is not None:
        for owner, name in ((gpt, "forward"), (gpt, "compute_language_model_loss"), (state["layer"], "forward")):
            vars(owner).pop(name, None)
    return model


def _wrap(gpt, layer, mode, options):
    model_forward = gpt.forward
    model_loss = gpt.compute_language_model_loss
    layer_forward = layer.forward
    signature = inspect.signature(model_forward)
    if "labels" not in signature.parameters:
        raise TypeError("vpce.megatron: expected GPTModel.forward to take `labels`; this megatron-core's does not")

    def forward(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        inference = bound.get("inference_context") is not None or bound.get("inference_params") is not None
        if bound.get("labels") is None or (inference and not gpt.training):
            return model_forward(*args, **kwargs)
        if mode == "chunked" and bound.get("loss_mask") is None and _POLICY.get() is None:
            raise ValueError("vpce.megatron: the chunked mode needs the forward's loss_mask (it sums the kept tokens' "
                             "losses in the forward)")
        token = _ACTIVE.set((gpt, bound.get("loss_mask")))
        try:
            return model_forward(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    def output_layer_forward(input_, weight=None, runtime_gather_output=None):
        active = _ACTIVE.get()
        if active is None or active[0] is not gpt:
            return layer_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if runtime_gather_output:
            raise ValueError("vpce.megatron: runtime_gather_output=True is not supported with labels (the fused "
                             "head never builds the logits it would gather)")
        if weight is None:
            weight = layer.weight
        elif tuple(weight.shape) != (layer.output_size_per_partition, layer.input_size):
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not "
                               f"{(layer.output_size_per_partition, layer.input_size)} as expected")
        return _Deferred(layer, input_, weight), (layer.bias if layer.skip_bias_add else None)

    def compute_language_model_loss(labels, logits):
        if not isinstance(logits, _Deferred):
            return model_loss(labels, logits)
        policy = _POLICY.get()
        if policy is not None and policy[0] is gpt:
            return _fused_policy(gpt, labels, logits, options, policy[1])
        return _fused_loss(gpt, labels, logits, mode, options, _ACTIVE.get()[1])

    vars(gpt)["forward"] = forward
    vars(gpt)["compute_language_model_loss"] = compute_language_model_loss
    vars(layer)["forward"] = output_layer_forward
    vars(gpt)["_vpce_fused"] = {"layer": layer, "mode": mode}


def _tp_group(gpt, layer):
    group = getattr(layer, "tp_group", None)
    if group is None:
        group = getattr(getattr(gpt, "pg_collection", None), "tp", None)
    if group is None:
        from megatron.core import parallel_state  # noqa: PLC0415

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def _fused_loss(gpt, labels, deferred, mode, options, loss_mask):
    """GPTModel.compute_language_model_loss(labels [b, s], logits) on the deferred operands:
    the per-token loss [b, s]."""
    layer = deferred.layer
    target = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b]
    common = dict(tp_group=_tp_group(gpt, layer), bias=None if layer.skip_bias_add else layer.bias,
                  sequence_parallel=bool(layer.sequence_parallel),
                  gradient_accumulation_fusion=bool(layer.gradient_accumulation_fusion), **options)
    if mode == "recompute":
        loss = vt.linear_cross_entropy(deferred.hidden, deferred.weight, target, mode="recompute", reduction="none",
                                       **common)
        return loss.transpose(0, 1).contiguous()
    # chunked (no MTP): the sum over the tokens loss_mask keeps (the others ignored), held by the
    # first kept token, every other token 0: (loss * loss_mask).sum() then adds zeros to it,
    # exactly, where a sum of the mean at every kept token would round at every addition.
    ignore = options.get("ignore_index", -100)
    kept = loss_mask.transpose(0, 1) != 0
    total = vt.linear_cross_entropy(deferred.hidden, deferred.weight, target.masked_fill(~kept, ignore),
                                    mode="chunked", reduction="sum", **common)
    # The first kept token, found on the device (no host synchronisation, as nonzero would make).
    kept_flat = loss_mask.reshape(-1) != 0
    holder = (kept_flat & (kept_flat.cumsum(0) == 1)).to(total.dtype)
    return total * holder.view(labels.shape)


def _fused_policy(gpt, labels, deferred, options, request):
    """The RL outputs of labels [b, s] on the deferred operands: the log-probabilities [b, s]
    returned, the entropy [b, s] into request.entropy."""
    layer = deferred.layer
    target = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b]
    # Per-token values follow the labels [b, s] (one per sequence: [b]), then go to [s, b].
    temperature = _sequence_major(request.temperature, labels)
    kept = {k: v for k, v in options.items() if k in _POLICY_OPTIONS}
    common = dict(tp_group=_tp_group(gpt, layer), bias=None if layer.skip_bias_add else layer.bias,
                  sequence_parallel=bool(layer.sequence_parallel),
                  gradient_accumulation_fusion=bool(layer.gradient_accumulation_fusion), **kept)
    if request.weights is not None:
        weights = [_sequence_major(w, labels) for w in request.weights]
        objective, log_prob, entropy = vt.linear_policy_objective(deferred.hidden, deferred.weight, target, *weights,
                                                                  temperature, **common)
        request.log_prob = log_prob.transpose(0, 1).contiguous()
        request.entropy = entropy.transpose(0, 1).contiguous()
        return objective
    log_prob, entropy = vt.linear_log_probs_and_entropy(deferred.hidden, deferred.weight, target, temperature,
                                                        **common)
    request.entropy = entropy.transpose(0, 1).contiguous()
    return log_prob.transpose(0, 1).contiguous()


def _sequence_major(values, labels):
    """Per-token values given for labels [b, s] (a tensor of one per token, or fewer dimensions
    aligned with the first: [b] one per sequence, 0-d one for all) as [s, b]; anything else as
    given, for vpce.torch to refuse by name inside its collective's scaffolding (alike on every
    rank, none left waiting)."""
    if not isinstance(values, torch.Tensor) or _token_shape_problem(values.shape, labels.shape) is not None:
        return values
    expanded = values.reshape(tuple(values.shape) + (1,) * (labels.dim() - values.dim())).expand(labels.shape)
    return expanded.transpose(0, 1).contiguous()


def log_probs_and_entropy(model, *args, labels, temperature=1.0, **kwargs):
    """(log_prob, entropy), each [b, s] float32 and differentiable: the log-probability of
    each of `labels` [b, s] and the entropy of the policy, at `temperature` (a number, or a
    tensor of one per token [b, s] or per sequence [b]), from the forward of `model` (fused by
    fuse_output_layer) given `args` and `kwargs` (input_ids, position_ids, attention_mask, ...):
    the hidden states go through vpce's head without the logits being built. A label equal to
    the fused options' ignore_index (default -100) gives 0 for both. The options given to
    fuse_output_layer that apply (round_logits, bf16_logit_gradients, the tiles, logit_scale,
    softcap, valid_vocab_size, ignore_index) apply. Not with multi-token prediction."""
    gpt = _unwrap(model)
    request = _PolicyRequest(temperature)
    return _policy_forward(model, gpt, args, labels, kwargs, request), request.entropy


def policy_objective(model, *args, labels, log_prob_weights, entropy_weights=None, temperature=1.0, **kwargs):
    """(objective, log_prob, entropy) from the forward of `model` (fused by fuse_output_layer),
    for a step whose upstream gradients are known before it (the on-policy step of GRPO or
    REINFORCE: log_prob_weights = -advantages * mask / mask.sum()): objective = sum of
    log_prob_weights * log_prob + entropy_weights * entropy, 0-d and differentiable, its
    gradients at the output layer computed in this forward by the head's chunked mode
    (vpce.torch.linear_policy_objective); log_prob and entropy [b, s] without gradient.
    log_prob_weights, entropy_weights: one per token [b, s], or per sequence [b] (the
    temperature's rule; entropy_weights None: 0).
    labels, temperature, args and kwargs as log_probs_and_entropy's; the fused options'
    chunk_tokens applies too. One backward per call."""
    gpt = _unwrap(model)
    if log_prob_weights is None and entropy_weights is None:
        raise ValueError("log_prob_weights: expected a tensor [b, s] (or entropy_weights), got None for both")
    request = _PolicyRequest(temperature, (log_prob_weights, entropy_weights))
    objective = _policy_forward(model, gpt, args, labels, kwargs, request, "policy_objective")
    return objective, request.log_prob, request.entropy


def _policy_forward(model, gpt, args, labels, kwargs, request, name="log_probs_and_entropy"):
    """The fused model's forward with `request` (what its compute_language_model_loss returns)."""
    if not is_fused(gpt):
        raise ValueError(f"vpce.megatron.{name}: expected a model given to fuse_output_layer first")
    if getattr(gpt.config, "mtp_num_layers", None):
        raise ValueError(f"vpce.megatron.{name}: not supported: multi-token prediction (its heads would take the "
                         "loss's path)")
    if labels is None:
        raise ValueError("labels: expected the sampled tokens [b, s], got None")
    token = _POLICY.set((gpt, request))
    try:
        return model(*args, labels=labels, **kwargs)
    finally:
        _POLICY.reset(token)
