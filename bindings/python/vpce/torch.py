"""vpce.torch: vpce as a drop-in for Megatron-LM's vocab-parallel cross-entropy.

    from vpce.torch import vocab_parallel_cross_entropy
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing, tp_group=group)

Same signature, shapes and return value as
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``: logits ``[s, b, V/R]`` on
each of the R ranks of ``tp_group`` (rank r holds columns ``[r V/R, (r+1) V/R)``), targets
``[s, b]`` of global class ids, the per-token loss ``[s, b]`` in float32 returned on every
rank. The forward makes one all-gather on ``tp_group`` instead of Megatron's three
all-reduces; the backward makes none, and only the per-token lse (float64, 8 bytes per token) is
kept between them, not a softmax of the logits' size. Label smoothing is exact across ranks
(Megatron's uses the shard's size and mean, so its loss differs between ranks);
``megatron_legacy_label_smoothing=True`` reproduces Megatron's values for anyone who needs
parity with a past run.

The all-gather carries one block per rank of a size every rank computes alike (4096 bytes
at first): a 36-byte block header, then vpce's payload (an 832-byte header and 16 bytes per
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

This module is the public surface; the implementation is in private modules, one purpose
each: _torch_groups (what tp_group means), _torch_collective (the all-gather's blocks and
the agreement on errors), _torch_arguments (checks and layouts), _torch_legacy (Megatron's
legacy label smoothing), _torch_function (the autograd.Function path), _torch_ops (the
custom ops), _torch_compile (torch.compile and torch.library), _torch_helpers (the static
helpers), _torch_head (the fused head, linear_cross_entropy: its autograd.Function, its
collectives and its custom ops).
"""
from __future__ import annotations

import sys

import torch

from . import _vpce  # noqa: F401 (vpce.torch._vpce: the kernels, as tests reach them)
from ._torch_arguments import _reverse_mode_only
from ._torch_compile import _CUSTOM_OPS, _compiling
from ._torch_function import _new_gradient  # noqa: F401 (bench/new_gradient.py times it)
from ._torch_function import _VocabParallelCrossEntropy, _VpceCrossEntropy
# Megatron's module imports these three from parallel_state; code (and Megatron's own tests)
# that patches them on this module changes what tp_group=None means here too (_torch_groups
# calls get_tensor_model_parallel_group through this module).
from ._torch_groups import (get_tensor_model_parallel_group, get_tensor_model_parallel_rank,
                            get_tensor_model_parallel_world_size)
from ._torch_head import linear_cross_entropy
from ._torch_helpers import VocabParallelCrossEntropy
from ._torch_ops import _encode_options, _fits_op, _group_key, _without_data
from ._torch_rl import log_probs_and_entropy, sum_pi_squared
from ._torch_rl_head import linear_log_probs_and_entropy, linear_policy_objective

__all__ = ["VocabParallelCrossEntropy", "_VocabParallelCrossEntropy", "vocab_parallel_cross_entropy",
           "unfused_cross_entropy", "fused_vocab_parallel_cross_entropy", "get_tensor_model_parallel_group",
           "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "linear_cross_entropy",
           "log_probs_and_entropy", "linear_log_probs_and_entropy", "linear_policy_objective",
           "sum_pi_squared"]


@_reverse_mode_only("vocab_parallel_logits")
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
        F.cross_entropy's (which also takes 1).
    tp_group: the tensor-parallel process group, used as given (any object with .rank()
        and .size() when its size is 1); None means Megatron's tensor-parallel group when
        Megatron is initialised, else a single rank when torch.distributed is not
        initialised or has one rank; None with a default group of several ranks and no
        Megatron raises ValueError (pass the group: WORLD for tensor parallelism, a group
        of one for data parallelism).
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
    # (Fake and meta tensors, which have no values to write over, take the op as compiling does.)
    compiling = _CUSTOM_OPS and (_compiling() or _without_data(vocab_parallel_logits))
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
