"""vpce.nemo_rl: a drop-in for NeMo-RL's ``from_parallel_logits_to_logprobs``
(``nemo_rl/distributed/model_utils.py``), with its signature and return value::

    from vpce.nemo_rl import from_parallel_logits_to_logprobs

logits ``[B, S, V/TP]`` of this rank's vocabulary range, the unshifted targets ``[B, S]``;
returns the log-probabilities of the next tokens ``[B, S - 1]`` (float32, differentiable):
one all-gather where NeMo-RL makes three all-reduces, nothing in the backward, no softmax
saved, and no chunking needed (vpce keeps 16 bytes a token whatever the chunk).
"""
from __future__ import annotations

import contextlib

import torch

from ._torch_groups import _group
from ._torch_rl import log_probs_and_entropy

__all__ = ["from_parallel_logits_to_logprobs"]


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
                                     inference_only=False, cp_group=None, chunk_size=None, sampling_params=None):
    """Log-probabilities [B, S - 1] of target[:, 1:] under the logits of [:, :-1]."""
    if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
        raise ValueError("cp_group: expected None or a group of one rank (vpce.nemo_rl does not split the sequence "
                         f"over context parallelism), got a group of {torch.distributed.get_world_size(cp_group)}")
    del chunk_size  # vpce keeps O(tokens) state: no chunks needed
    # NeMo-RL reads only top_k and top_p here; its policy workers divide the logits by the
    # temperature before the call, so the temperature is not applied again.
    if sampling_params is not None and (getattr(sampling_params, "top_k", None) not in (None, -1)
                                        or getattr(sampling_params, "top_p", 1.0) != 1.0):
        raise ValueError("sampling_params: expected no top-k or top-p filtering (vpce.nemo_rl computes the "
                         "log-probabilities over the whole vocabulary; give the support as -inf logits, docs/rl.md), "
                         f"got top_k={getattr(sampling_params, 'top_k', None)}, "
                         f"top_p={getattr(sampling_params, 'top_p', 1.0)}")
    _, rank, size = _group(tp_group)
    local = vocab_parallel_logits.shape[-1]
    if (vocab_start_index, vocab_end_index) != (rank * local, (rank + 1) * local):
        raise ValueError(f"vocab_start_index, vocab_end_index: expected rank {rank}'s even range "
                         f"({rank * local}, {(rank + 1) * local}) of [0, {size * local}), got "
                         f"({vocab_start_index}, {vocab_end_index})")
    shifted = target.roll(shifts=-1, dims=-1)
    with torch.no_grad() if inference_only else contextlib.nullcontext():  # (the caller's grad mode otherwise)
        log_prob, _ = log_probs_and_entropy(vocab_parallel_logits, shifted, tp_group=tp_group)
    return log_prob[:, :-1]
