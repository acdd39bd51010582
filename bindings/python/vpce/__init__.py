"""vpce: exact vocab-parallel cross-entropy, its C++ kernels over any DLPack tensor.

The functions take tensors from any framework that speaks DLPack (PyTorch, NumPy, JAX,
CuPy) and write their outputs into tensors the caller allocates; see vpce.torch for the
PyTorch autograd function that does all of that for you, as a drop-in for Megatron-LM's
``vocab_parallel_cross_entropy``.

One-call API::

    vpce.forward(logits, targets, vocab_begin, vocab_end, vocab_size, options, loss, lse,
                 rank=r, size=R, all_gather=fn)   # fn(send, recv): the one collective
    vpce.backward(logits, targets, lse, grad_loss, vocab_begin, vocab_end, vocab_size,
                  options, grad_logits)           # no collective

Staged API (a framework that runs its own all-gather): calculate_local_stats,
merge_stats, calculate_loss, then backward. Errors raise vpce.Error, whose message names
the argument, the expected and the actual value.

The fused head (linear + cross-entropy without the logits; vpce.torch.linear_cross_entropy
wraps it): linear_cross_entropy_forward / _backward (recompute mode), _forward_backward
(chunked mode), _local_stats (staged), all_reduce_hidden_gradient, with HeadOptions.
"""
from ._vpce import (
    STATS_WIDTH,
    STATS_WIDTH_WITH_EXTRAS,
    Error,
    HeadOptions,
    LossOptions,
    Reduction,
    SmoothingSemantics,
    __version__,
    backward,
    calculate_local_stats,
    calculate_loss,
    all_reduce_hidden_gradient,
    forward,
    linear_cross_entropy_backward,
    linear_cross_entropy_forward,
    linear_cross_entropy_forward_backward,
    linear_cross_entropy_local_stats,
    merge_stats,
    RlOptions,
    rl_backward,
    rl_forward,
)

__all__ = [
    "STATS_WIDTH",
    "STATS_WIDTH_WITH_EXTRAS",
    "Error",
    "HeadOptions",
    "LossOptions",
    "Reduction",
    "SmoothingSemantics",
    "__version__",
    "backward",
    "calculate_local_stats",
    "calculate_loss",
    "all_reduce_hidden_gradient",
    "forward",
    "linear_cross_entropy_backward",
    "linear_cross_entropy_forward",
    "linear_cross_entropy_forward_backward",
    "linear_cross_entropy_local_stats",
    "merge_stats",
    "RlOptions",
    "rl_backward",
    "rl_forward",
]
