"""vpce.verl: drop-ins for verl's tensor-parallel RL functions
(``verl/utils/megatron/tensor_parallel.py``), with their signatures and return values::

    from vpce.verl import vocab_parallel_entropy, vocab_parallel_log_probs_from_logits

on logits ``[..., V/R]`` split over Megatron's tensor-parallel group (as verl's are): one
all-gather per call where verl makes three all-reduces, nothing in the backward, no copy of
the logits and no softmax saved (16 bytes a token instead), exact against float64
(docs/rl.md). The logits are read, never modified.
"""
from __future__ import annotations

import torch

from ._torch_rl import log_probs_and_entropy, sum_pi_squared

__all__ = ["vocab_parallel_entropy", "vocab_parallel_log_probs_from_logits", "vocab_parallel_sum_pi_squared"]


def vocab_parallel_log_probs_from_logits(logits, labels):
    """log p(labels) of each row of vocab-parallel logits: float32 of the labels' shape,
    differentiable (verl's: minus Megatron's vocab_parallel_cross_entropy)."""
    log_prob, _ = log_probs_and_entropy(logits, labels)
    return log_prob


def vocab_parallel_entropy(vocab_parallel_logits):
    """The entropy of softmax(logits) of each row: float32 of the logits' leading shape,
    differentiable (verl's _VocabParallelEntropy)."""
    tokens = torch.zeros(vocab_parallel_logits.shape[:-1], dtype=torch.int64, device=vocab_parallel_logits.device)
    _, entropy = log_probs_and_entropy(vocab_parallel_logits, tokens)
    return entropy


def vocab_parallel_sum_pi_squared(vocab_parallel_logits):
    """sum_v p_v^2 of each row: float32 of the logits' leading shape (verl's
    vocab_parallel_sum_pi_squared: one all-gather where it makes three all-reduces). Not
    differentiated (vpce returns it detached)."""
    return sum_pi_squared(vocab_parallel_logits)
