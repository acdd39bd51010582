"""vpce's raw API over DLPack without PyTorch: NumPy arrays through the one-call and the
staged API, against a float64 NumPy reference. Runs in a fresh virtual environment that
has only vpce, NumPy and pytest."""
import numpy as np
import pytest

import vpce


def reference(logits, target):
    """float64 per-token loss, lse and gradient (upstream gradient 1) of [N, V] logits."""
    z = logits.astype(np.float64)
    top = z.max(axis=1, keepdims=True)
    lse = (top + np.log(np.exp(z - top).sum(axis=1, keepdims=True)))[:, 0]
    loss = lse - z[np.arange(len(target)), target]
    grad = np.exp(z - lse[:, None])
    grad[np.arange(len(target)), target] -= 1.0
    return loss, lse, grad


def relative_error(actual, expected):
    return np.abs(actual.astype(np.float64) - expected).max() / np.abs(expected).max()


@pytest.fixture
def problem():
    rng = np.random.default_rng(3)
    n, vocab = 9, 64
    logits = (3 * rng.standard_normal((n, vocab))).astype(np.float32)
    target = rng.integers(0, vocab, n).astype(np.int64)
    return logits, target


def test_one_call(problem):
    logits, target = problem
    n, vocab = logits.shape
    loss = np.zeros(n, np.float32)
    lse = np.zeros(n, np.float32)
    vpce.forward(logits, target, 0, vocab, vocab, vpce.LossOptions(), loss, lse)
    want_loss, want_lse, want_grad = reference(logits, target)
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(lse, want_lse) < 1e-6
    grad = np.zeros_like(logits)
    vpce.backward(logits, target, lse, np.ones(n, np.float32), 0, vocab, vocab, vpce.LossOptions(), grad)
    assert relative_error(grad, want_grad) < 1e-6


def test_staged_two_shards_gathered_by_hand(problem):
    logits, target = problem
    n, vocab = logits.shape
    options = vpce.LossOptions()
    stats = np.zeros((2, n, vpce.STATS_WIDTH), np.float32)
    for r in range(2):  # each "rank" reads its columns through the row stride of the full array
        vpce.calculate_local_stats(logits[:, 32 * r:32 * (r + 1)], target, 32 * r, 32 * (r + 1), vocab, options,
                                   stats[r])
    merged = np.zeros((n, vpce.STATS_WIDTH), np.float32)
    vpce.merge_stats(stats, options, merged)
    loss = np.zeros(n, np.float32)
    lse = np.zeros(n, np.float32)
    vpce.calculate_loss(merged, target, vocab, options, loss, lse)
    want_loss, _, want_grad = reference(logits, target)
    assert relative_error(loss, want_loss) < 1e-6
    grad = np.zeros((n, 32), np.float32)
    vpce.backward(logits[:, 32:], target, lse, np.ones(n, np.float32), 32, 64, vocab, options, grad)
    assert relative_error(grad, want_grad[:, 32:]) < 1e-6


def test_options_object_and_reduction(problem):
    logits, target = problem
    n, vocab = logits.shape
    options = vpce.LossOptions()
    options.reduction = vpce.Reduction.MEAN
    options.ignore_index = int(target[0])
    loss = np.zeros(1, np.float32)
    lse = np.zeros(n, np.float32)
    vpce.forward(logits, target, 0, vocab, vocab, options, loss, lse)
    want_loss, _, _ = reference(logits, target)
    counted = target != target[0]
    assert abs(loss[0] - want_loss[counted].mean()) < 1e-6 * abs(want_loss[counted].mean())


def test_errors_name_the_argument(problem):
    logits, target = problem
    n, vocab = logits.shape
    loss = np.zeros(n, np.float32)
    lse = np.zeros(n, np.float32)
    with pytest.raises(vpce.Error, match="loss.dtype"):
        vpce.forward(logits, target, 0, vocab, vocab, vpce.LossOptions(), loss.astype(np.float64), lse)
    with pytest.raises(vpce.Error, match="shard"):
        vpce.forward(logits, target, 10, 5, vocab, vpce.LossOptions(), loss, lse)
    with pytest.raises(TypeError):  # read-only outputs are refused before vpce sees them
        readonly = np.zeros(n, np.float32)
        readonly.setflags(write=False)
        vpce.forward(logits, target, 0, vocab, vocab, vpce.LossOptions(), readonly, lse)
