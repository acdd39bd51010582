"""megatron_legacy_label_smoothing=True: Megatron's own label smoothing, which smooths over
each rank's shard (its size and its mean log-probability, so the loss differs by rank), for
parity with a past run. vpce computes it natively (SmoothingSemantics.MEGATRON_LEGACY, in the
loss and in the fused head); this module turns the flag into that option."""
from __future__ import annotations

from ._torch_arguments import _real


def _legacy_options(label_smoothing, options):
    """`options` with Megatron's legacy smoothing semantics; ValueError when the options name
    other semantics or the smoothing is outside [0, 1). (A shard of fewer than 2 valid
    columns is vpce's error: the formula divides by K - 1.)"""
    if "smoothing_semantics" in options:
        raise ValueError("megatron_legacy_label_smoothing: expected no smoothing_semantics (the flag sets them), got "
                         f"smoothing_semantics={options['smoothing_semantics']!r}")
    alpha = _real(label_smoothing, "label_smoothing")
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1), got {alpha}")
    return dict(options, smoothing_semantics="megatron_legacy")
