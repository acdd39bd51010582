"""megatron_legacy_label_smoothing=True: Megatron's own label smoothing (the shard's size
and the shard's mean log-probability, different on every rank), its loss and gradient
derived from vpce's plain ones, for parity with a past run."""
from __future__ import annotations

import torch

from ._torch_arguments import _real

_LEGACY_IGNORE_INDEX = -100  # the legacy path takes no options, so ignore_index keeps its default


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


_ROWS_PER_BLOCK = 256


def _row_means(x):
    """Each row's mean in fp64 (an fp32 mean of large logits cancels against the lse: 8e-6
    of the loss at logits of 1e4), a block of rows at a time, so that the fp64 copy stays
    small."""
    rows = x.reshape(-1, x.shape[-1])
    means = torch.empty(rows.shape[0], dtype=torch.float64, device=x.device)
    for begin in range(0, rows.shape[0], _ROWS_PER_BLOCK):
        means[begin:begin + _ROWS_PER_BLOCK] = rows[begin:begin + _ROWS_PER_BLOCK].double().mean(dim=-1)
    return means.reshape(x.shape[:-1])


def _legacy_loss(x, y, lse, loss, alpha):
    """Megatron's loss with label smoothing: the shard's size K and the shard's mean
    log-probability, (1 - s) loss - s mean_v(z_v - lse) with s = alpha K / (K - 1); 0 for
    an ignored token, as vpce's own loss."""
    k = x.shape[-1]
    s = alpha * k / (k - 1)
    mean_log_probs = _row_means(x).reshape(lse.shape) - lse.double()
    smoothed = ((1.0 - s) * loss.double() - s * mean_log_probs).to(loss.dtype)
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
