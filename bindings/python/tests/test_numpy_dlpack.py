"""vpce's raw API over DLPack without PyTorch: NumPy arrays through the one-call and the
staged API, against a float64 NumPy reference. Runs in a fresh virtual environment that
has only vpce, NumPy and pytest."""
import subprocess
import sys

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


@pytest.mark.parametrize("lse_dtype", [np.float64, np.float32])
def test_one_call(problem, lse_dtype):
    logits, target = problem
    n, vocab = logits.shape
    loss = np.zeros(n, np.float32)
    lse = np.zeros(n, lse_dtype)
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


def test_a_float64_lse_keeps_the_gradient_exact_at_logits_of_1e4(problem):
    """The staged loss into a float64 lse, then the backward: the gradient within 1e-6 at an
    offset of 1e4, where a float32 lse's rounding (2^-10) costs it about 1e-4."""
    logits, target = problem
    logits = (logits.astype(np.float64) + 1e4).astype(np.float32)
    n, vocab = logits.shape
    options = vpce.LossOptions()
    stats = np.zeros((n, vpce.STATS_WIDTH), np.float32)
    vpce.calculate_local_stats(logits, target, 0, vocab, vocab, options, stats)
    _, _, want_grad = reference(logits, target)
    errors = {}
    for dtype in (np.float64, np.float32):
        loss, lse = np.zeros(n, np.float32), np.zeros(n, dtype)
        vpce.calculate_loss(stats, target, vocab, options, loss, lse)
        grad = np.zeros_like(logits)
        vpce.backward(logits, target, lse, np.ones(n, np.float32), 0, vocab, vocab, options, grad)
        errors[dtype] = relative_error(grad, want_grad)
    assert errors[np.float64] < 1e-6
    assert errors[np.float32] > 1e-5


def test_staged_smoothing_of_large_close_together_logits_takes_the_shards():
    """With label smoothing each rank's sum of logits is relative to its max, so merging
    more than one rank needs their shards; given them, the smoothed loss of logits near 1e5
    keeps its 1e-6 (PyTorch's semantics, against float64)."""
    rng = np.random.default_rng(5)
    n, vocab, split = 7, 3000, 1100
    logits = (1e5 + 3 * rng.standard_normal((n, vocab))).astype(np.float32)
    target = rng.integers(0, vocab, n).astype(np.int64)
    options = vpce.LossOptions()
    options.label_smoothing = 0.1
    options.smoothing_semantics = vpce.SmoothingSemantics.PYTORCH
    shards = [(0, split, vocab), (split, vocab, vocab)]
    stats = np.zeros((2, n, vpce.STATS_WIDTH), np.float32)
    for r, (begin, end, _) in enumerate(shards):
        vpce.calculate_local_stats(logits[:, begin:end], target, begin, end, vocab, options, stats[r])
    merged = np.zeros((n, vpce.STATS_WIDTH), np.float32)
    with pytest.raises(vpce.Error, match="shards"):
        vpce.merge_stats(stats, options, merged)
    vpce.merge_stats(stats, options, merged, shards)
    loss = np.zeros(n, np.float32)
    lse = np.zeros(n, np.float32)
    vpce.calculate_loss(merged, target, vocab, options, loss, lse)
    nll, want_lse, _ = reference(logits, target)
    want = 0.9 * nll + 0.1 * (want_lse - logits.astype(np.float64).mean(axis=1))
    assert np.abs(loss - want).max() <= 1e-6 * np.abs(want).max()


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


def test_outputs_and_inputs_it_cannot_import_are_named(problem):
    logits, target = problem
    n, vocab = logits.shape
    lse = np.zeros(n, np.float32)
    readonly = np.zeros(n, np.float32)
    readonly.setflags(write=False)
    with pytest.raises(TypeError, match=r"^loss: expected a writable array .*got a numpy\.ndarray \(dtype float32(, device cpu)?\) "
                                        r"that is read-only$"):
        vpce.forward(logits, target, 0, vocab, vocab, vpce.LossOptions(), readonly, lse)
    with pytest.raises(TypeError, match=r"^logits: expected an array .*native byte order\), got a numpy\.ndarray "
                                        r"\(dtype >f4(, device cpu)?\) whose DLPack export fails: .*byte order"):
        vpce.forward(logits.astype(">f4"), target, 0, vocab, vocab, vpce.LossOptions(), np.zeros(n, np.float32), lse)
    with pytest.raises(TypeError, match=r"^targets: expected an array .*got None$"):
        vpce.forward(logits, None, 0, vocab, vocab, vpce.LossOptions(), np.zeros(n, np.float32), lse)
    with pytest.raises(TypeError, match=r"^grad_logits: expected a writable array .*got a list"):
        vpce.backward(logits, target, lse, lse, 0, vocab, vocab, vpce.LossOptions(), [0.0])


@pytest.mark.parametrize("name, value, error, fragment", [
    ("ignore_index", 2**63, ValueError,
     r"^options\.ignore_index: expected an integer in \[-9223372036854775808, 9223372036854775807\], "
     r"got 9223372036854775808$"),
    ("num_threads", -2**31 - 1, ValueError,
     r"^options\.num_threads: expected an integer in \[-2147483648, 2147483647\], got -2147483649$"),
    ("valid_vocab_size", "10", TypeError, r"^options\.valid_vocab_size: expected an integer, got str '10'$"),
    ("label_smoothing", None, TypeError, r"^options\.label_smoothing: expected a number, got NoneType None$"),
    ("reduction", "mean", TypeError, r"^options\.reduction: expected a vpce\._vpce\.Reduction, got 'mean'$"),
])
def test_options_of_the_wrong_type_or_range_name_the_field(name, value, error, fragment):
    options = vpce.LossOptions()
    with pytest.raises(error, match=fragment):
        setattr(options, name, value)


def test_options_take_what_int_and_float_take():
    options = vpce.LossOptions()
    options.ignore_index = np.int64(-7)
    options.num_threads = 2**31 - 1
    options.label_smoothing = 1  # an int, as float() takes it
    options.z_loss_weight = np.float32(0.5)
    options.reduction = vpce.Reduction.SUM
    assert (options.ignore_index, options.num_threads, options.label_smoothing, options.z_loss_weight,
            options.reduction) == (-7, 2**31 - 1, 1.0, 0.5, vpce.Reduction.SUM)


# A collective that keeps the views it was given (and an array over one of them) and writes
# through them after forward() has returned: that must raise or be harmless, never reach
# vpce's freed buffers. The payload is large (20000 tokens, 320 KB) so that on a build that
# handed out its own buffers the write lands in unmapped memory and crashes.
LATE_WRITE = """
import numpy as np, vpce
kept = []
def gather(send, recv):
    recv[:] = send
    kept.extend([send, recv, np.frombuffer(recv, dtype=np.uint8)])
n, vocab = 20000, 8
logits = np.random.default_rng(0).standard_normal((n, vocab)).astype(np.float32)
target = np.zeros(n, np.int64)
loss, lse = np.zeros(n, np.float32), np.zeros(n, np.float32)
vpce.forward(logits, target, 0, vocab, vocab, vpce.LossOptions(), loss, lse, size=1, all_gather=gather)
for view in kept[:2]:
    try:
        view[:] = b"\\xff" * len(view)
        print("written")
    except ValueError as error:
        print("refused:", error)
kept[2][:] = 255  # an array over the view: it keeps Python-owned memory alive
print("array written")
want = np.log(np.exp(logits.astype(np.float64)).sum(axis=1)) - logits[:, 0]
assert np.abs(loss - want).max() < 1e-5 * np.abs(want).max()
print("ok")
"""


def test_collective_that_keeps_its_views_cannot_write_into_freed_memory():
    result = subprocess.run([sys.executable, "-c", LATE_WRITE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    assert result.stdout.splitlines()[:2] == ["refused: operation forbidden on released memoryview object"] * 2
    assert result.stdout.splitlines()[-2:] == ["array written", "ok"]


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit, _Interrupted, ValueError])
def test_what_the_collective_raises_comes_back_as_it_was(raised):
    # Ctrl-C or a framework's timeout inside the gather must reach the caller as itself (not
    # as a vpce.Error carrying a traceback as text, which `except Exception` would swallow);
    # and the outputs stay as they were.
    def gather(send, recv):
        raise raised("from the collective")

    logits = np.zeros((3, 4), np.float32)
    target = np.zeros(3, np.int64)
    loss, lse = np.full(3, -7, np.float32), np.full(3, -7, np.float32)
    with pytest.raises(raised, match="from the collective") as caught:
        vpce.forward(logits, target, 0, 4, 8, vpce.LossOptions(), loss, lse, rank=0, size=2, all_gather=gather)
    assert type(caught.value) is raised
    assert (loss == -7).all() and (lse == -7).all()


def test_options_copy_deepcopy_and_pickle():
    import copy
    import pickle

    options = vpce.LossOptions()
    options.label_smoothing = 0.25
    options.smoothing_semantics = vpce.SmoothingSemantics.PYTORCH
    options.ignore_index = -7
    options.z_loss_weight = 1e-4
    options.logit_scale = 0.5
    options.softcap = 30.0
    options.valid_vocab_size = 1000
    options.reduction = vpce.Reduction.MEAN
    options.num_threads = 1
    head = vpce.HeadOptions()
    head.token_block = 64
    head.vocab_block = 512
    head.chunk_tokens = 1024
    head.bf16_logit_gradients = True
    loss_fields = ("label_smoothing", "smoothing_semantics", "ignore_index", "z_loss_weight", "logit_scale", "softcap",
                   "valid_vocab_size", "reduction", "num_threads")
    head_fields = ("token_block", "vocab_block", "chunk_tokens", "bf16_logit_gradients")
    for original, fields in ((options, loss_fields), (head, head_fields)):
        for made in (copy.copy(original), copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
            assert type(made) is type(original) and made is not original
            assert [getattr(made, f) for f in fields] == [getattr(original, f) for f in fields]
    # A state that the setters would refuse is refused on the way in too.
    state = options.__getstate__()
    state["ignore_index"] = "seven"
    fresh = vpce.LossOptions.__new__(vpce.LossOptions)
    with pytest.raises(TypeError, match="options.ignore_index: expected an integer"):
        fresh.__setstate__(state)


def test_a_group_error_reads_the_same_on_every_rank():
    # Two ranks as threads with an in-process gather; rank 1's targets are out of range. The
    # C++ status codes differ (the failing rank's own, remote error elsewhere); the raised
    # text is the same on both: "rank 1 of 2: invalid argument: targets: ...".
    import threading

    size, vocab = 2, 8
    barrier = threading.Barrier(size)
    slots = [b""] * size

    def gather_for(rank):
        def gather(send, recv):
            slots[rank] = bytes(send)
            barrier.wait()
            recv[:] = b"".join(slots)
            barrier.wait()
        return gather

    logits = np.random.default_rng(3).standard_normal((3, vocab)).astype(np.float32)
    texts = [None] * size

    def rank_main(rank):
        target = np.array([1, 12 if rank == 1 else 2, 3], np.int64)
        loss, lse = np.zeros(3, np.float32), np.zeros(3, np.float32)
        half = vocab // size
        try:
            vpce.forward(logits[:, rank * half:(rank + 1) * half], target, rank * half, (rank + 1) * half, vocab,
                         vpce.LossOptions(), loss, lse, rank=rank, size=size, all_gather=gather_for(rank))
        except vpce.Error as error:
            texts[rank] = str(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert texts[0] == texts[1], texts
    assert texts[0].startswith("rank 1 of 2: invalid argument: targets: expected values in [0, 8)"), texts
