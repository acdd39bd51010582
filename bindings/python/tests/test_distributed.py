"""vpce.torch on real torch.distributed groups: 1, 2, 3 and 4 processes over gloo, each holding
its shard of the vocabulary, against the float64 PyTorch reference; exactly one collective
per forward and none per backward, counted (two when the payload first outgrows the agreed
blocks); the same loss on every rank; label smoothing exact for logits near 1e5; ranks that disagree (on V, the number of tokens, the
legacy smoothing) and a rank that fails before the gather all give every rank the same
error; Megatron's legacy smoothing reproduced on request. Every group has a 60 s timeout and
every test a deadline, so a regression fails instead of hanging."""
import datetime
import functools
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vpce
import vpce.torch as vt
from reference import loss_and_grad, megatron_legacy, relative_error

GROUP_TIMEOUT = datetime.timedelta(seconds=60)  # gloo's own, per collective
TEST_DEADLINE_S = 240  # per spawned test, start-up included

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "barrier", "gather", "scatter", "all_to_all", "send", "recv", "isend",
               "irecv")


class CollectiveCounter:
    """Counts calls to torch.distributed's collectives while installed."""

    def __init__(self):
        self.calls = []
        self.saved = {}

    def __enter__(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                original = getattr(dist, name)
                self.saved[name] = original

                def counted(*args, _name=name, _original=original, **kwargs):
                    self.calls.append(_name)
                    return _original(*args, **kwargs)

                setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def global_problem(seed, shape=(5, 3), vocab=4 * 97, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=generator, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, vocab, shape, generator=generator)
    grad_loss = torch.rand(shape, generator=generator) + 0.5
    return logits, target, grad_loss


def check_case(group, rank, size, dtype, label_smoothing, inplace, options):
    logits, target, grad_loss = global_problem(seed=7, dtype=dtype)
    if "ignore_index" in options:
        target[0] = options["ignore_index"]  # a whole row of ignored tokens
    vocab = logits.shape[-1]
    local = vocab // size
    begin, end = rank * local, (rank + 1) * local
    full = logits.clone().requires_grad_()
    # Out of place: the rank's columns as a strided view of the full tensor (row stride V).
    # In place: a separate non-leaf copy whose buffer the backward may overwrite.
    x = full[..., begin:end] if not inplace else full[..., begin:end] * 1
    with CollectiveCounter() as forward_calls:
        loss = vt.vocab_parallel_cross_entropy(x, target, label_smoothing, tp_group=group, inplace_backward=inplace,
                                               **options)
    with CollectiveCounter() as backward_calls:
        loss.backward(grad_loss)
    assert forward_calls.calls == ["all_gather"] if size > 1 else forward_calls.calls == [], forward_calls.calls
    assert backward_calls.calls == [], backward_calls.calls

    semantics = options.get("smoothing_semantics", "megatron")
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss, label_smoothing=label_smoothing,
                                         semantics=semantics, ignore_index=options.get("ignore_index", -100))
    grad = full.grad[..., begin:end]
    if dtype == torch.float32:
        assert relative_error(loss, want_loss) < 1e-6
        assert relative_error(grad, want_grad[..., begin:end]) < 1e-6
    else:  # bf16 logits: fp32 math, the gradient rounded once to bf16
        assert relative_error(loss, want_loss) < 1e-6
        assert relative_error(grad, want_grad[..., begin:end]) < 2.0**-7
    # Every rank holds the bit-identical loss.
    losses = [torch.empty_like(loss) for _ in range(size)]
    dist.all_gather(losses, loss.detach().contiguous(), group=group)
    assert all(torch.equal(other, losses[0]) for other in losses)


def check_large_close_together_logits(group, rank, size):
    """Label smoothing where every logit is near 1e5 (+- a few): each rank's sum of logits
    travels relative to its max, so the smoothed loss keeps its 1e-6 over the group (a plain
    fp32 sum of these 388 logits, about 3.9e7, rounds by up to 2: 5e-3 in their mean, up to
    9e-5 of the loss)."""
    logits, target, grad_loss = global_problem(seed=13)
    logits = (logits.double() + 1e5).float()
    vocab = logits.shape[-1]
    local = vocab // size
    x = logits[..., rank * local:(rank + 1) * local]
    for semantics in ("megatron", "pytorch"):
        loss = vt.vocab_parallel_cross_entropy(x, target, 0.1, tp_group=group, smoothing_semantics=semantics)
        want_loss, _ = loss_and_grad(logits, target, grad_loss, label_smoothing=0.1, semantics=semantics)
        assert ((loss.double() - want_loss).abs() / want_loss.abs()).max().item() < 1e-6, semantics


def check_legacy(group, rank, size):
    logits, target, grad_loss = global_problem(seed=11)
    vocab = logits.shape[-1]
    local = vocab // size
    begin, end = rank * local, (rank + 1) * local
    x = logits[..., begin:end].clone().requires_grad_()
    loss = vt.vocab_parallel_cross_entropy(x, target, 0.1, tp_group=group, megatron_legacy_label_smoothing=True)
    loss.backward(grad_loss)
    want_loss, want_grad = megatron_legacy(logits, target, begin, end, grad_loss, 0.1)
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(x.grad, want_grad) < 1e-6


def check_disagreement(group, rank, size):
    # The last rank holds one column more than the others: V disagrees.
    logits, target, _ = global_problem(seed=3, vocab=40)
    local = 40 // size + (1 if rank == size - 1 else 0)
    with pytest.raises(vpce.Error) as failure:
        vt.vocab_parallel_cross_entropy(logits[..., :local].contiguous(), target % 10, tp_group=group)
    messages = [None] * size
    dist.all_gather_object(messages, str(failure.value).split(": ", 1)[1], group=group)
    assert len(set(messages)) == 1, messages
    assert "vocabulary size" in messages[0] or "ranges" in messages[0], messages[0]


def init_group(rank, size, init_file):
    """This process's gloo group of `size` ranks (a group object, as Megatron passes), with
    a bounded timeout."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=GROUP_TIMEOUT)
    torch.set_num_threads(1)
    return dist.new_group(list(range(size)), timeout=GROUP_TIMEOUT)


def spawn(worker, size, **kwargs):
    """Runs worker(rank, size=size, init_file=..., **kwargs) in `size` processes; fails past
    TEST_DEADLINE_S (killing them) rather than hanging."""
    with tempfile.TemporaryDirectory() as directory:
        context = mp.spawn(functools.partial(worker, size=size, init_file=os.path.join(directory, "init"), **kwargs),
                           nprocs=size, join=False)
        deadline = time.monotonic() + TEST_DEADLINE_S
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{worker.__name__} with {size} ranks did not finish within {TEST_DEADLINE_S} s")


def worker(rank, size, init_file):
    group = init_group(rank, size, init_file)
    cases = [
        (torch.float32, 0.0, False, {}),
        (torch.float32, 0.1, False, {}),
        (torch.float32, 0.1, True, {}),
        (torch.float32, 0.2, False, {"smoothing_semantics": "pytorch", "ignore_index": 5}),
        (torch.bfloat16, 0.1, False, {}),
        (torch.bfloat16, 0.0, True, {}),
    ]
    for dtype, label_smoothing, inplace, options in cases:
        check_case(group, rank, size, dtype, label_smoothing, inplace, options)
    check_large_close_together_logits(group, rank, size)
    if size > 1:
        check_legacy(group, rank, size)
        check_disagreement(group, rank, size)
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_gloo_group(size):
    spawn(worker, size)


def same_outcome_on_every_rank(group, size, call):
    """(exception class name, text) of what call() raised here, ("", "") if nothing, after
    checking that every rank of the group got exactly the same."""
    try:
        call()
        outcome = ("", "")
    except Exception as error:  # noqa: BLE001 (any error must be the same everywhere)
        outcome = (type(error).__name__, str(error))
    outcomes = [None] * size
    dist.all_gather_object(outcomes, outcome, group=group)
    assert all(other == outcomes[0] for other in outcomes), outcomes
    return outcome


def one_rank_fails(x, target):
    """(what, the failing rank's arguments, exception class, message fragment): every error
    one rank can raise before the gather, for vocab_parallel_cross_entropy(logits, target,
    label_smoothing, **options)."""
    return [
        ("an unknown option", (x, target, 0.0, {"colour": "red"}), "TypeError", "unexpected options ['colour']"),
        ("an unknown smoothing semantics", (x, target, 0.1, {"smoothing_semantics": "nemo"}), "ValueError",
         "smoothing_semantics: expected 'megatron', 'pytorch' or 'megatron_legacy', got 'nemo'"),
        ("an option of the wrong type", (x, target, 0.0, {"ignore_index": "x"}), "TypeError",
         "options.ignore_index: expected an integer, got str 'x'"),
        ("an option out of range", (x, target, 0.0, {"num_threads": 2**40}), "ValueError",
         "options.num_threads: expected an integer in [-2147483648, 2147483647], got 1099511627776"),
        ("the legacy flag with other semantics",
         (x, target, 0.1, {"megatron_legacy_label_smoothing": True, "smoothing_semantics": "pytorch"}), "ValueError",
         "megatron_legacy_label_smoothing: expected no smoothing_semantics (the flag sets them), got "
         "smoothing_semantics='pytorch'"),
        ("legacy smoothing out of range", (x, target, 1.5, {"megatron_legacy_label_smoothing": True}), "ValueError",
         "label_smoothing: expected a value in [0, 1), got 1.5"),
        ("0-d logits", (torch.tensor(1.0), target, 0.0, {}), "ValueError",
         "vocab_parallel_logits.dim(): expected 1 to 8 dimensions ([..., V/R]), got 0"),
        ("9-d logits", (x.reshape(*[1] * 6, *x.shape), target.reshape(*[1] * 6, *target.shape), 0.0, {}),
         "ValueError", "vocab_parallel_logits.dim(): expected 1 to 8 dimensions ([..., V/R]), got 9"),
        ("bool logits", (x > 0, target, 0.0, {}), "TypeError",
         "vocab_parallel_logits.dtype: expected float32, bfloat16, float16 or float64, got torch.bool"),
        ("meta logits", (x.to("meta"), target, 0.0, {}), "ValueError",
         "vocab_parallel_logits.device: expected cpu or cuda, got meta"),
        ("float targets", (x, target.float(), 0.0, {}), "TypeError",
         "target.dtype: expected int32 or int64 (or a narrower integer type, widened), got torch.float32"),
        ("in place over a leaf", (x.clone().requires_grad_(), target, 0.0, {"inplace_backward": True}), "ValueError",
         "inplace_backward: expected logits that autograd lets be overwritten"),
    ]


def check_one_rank_fails(group, rank, size):
    logits, target, _ = global_problem(seed=5)
    x = logits[..., rank * (logits.shape[-1] // size):(rank + 1) * (logits.shape[-1] // size)]
    for number, (what, bad, kind, fragment) in enumerate(one_rank_fails(x, target)):
        failing = number % size
        args = bad if rank == failing else (x, target, 0.0, {})
        started = time.monotonic()
        outcome = same_outcome_on_every_rank(
            group, size, lambda: vt.vocab_parallel_cross_entropy(*args[:3], tp_group=group, **args[3]))
        assert outcome[0] == kind, (what, outcome)
        assert outcome[1].startswith(f"rank {failing} of {size}: ") and fragment in outcome[1], (what, outcome)
        assert time.monotonic() - started < 10, what  # at once, not after gloo's timeout


def check_token_counts_disagree(group, rank, size):
    # Rank 1 has more tokens than the others; in the second case its payload also outgrows
    # the agreed blocks (400 tokens: 6656 bytes > 4096).
    for tokens in (6, 400):
        logits, target, _ = global_problem(seed=9, shape=(tokens if rank == 1 else 5,), vocab=60)
        x = logits[..., rank * (60 // size):(rank + 1) * (60 // size)]
        outcome = same_outcome_on_every_rank(group, size,
                                             lambda: vt.vocab_parallel_cross_entropy(x, target, tp_group=group))
        assert outcome[0] == "Error" and "ranks disagree on the number of tokens" in outcome[1], outcome


def check_legacy_smoothing_disagrees(group, rank, size):
    logits, target, _ = global_problem(seed=13)
    x = logits[..., rank * (logits.shape[-1] // size):(rank + 1) * (logits.shape[-1] // size)]
    outcome = same_outcome_on_every_rank(group, size, lambda: vt.vocab_parallel_cross_entropy(
        x, target, 0.1 if rank == 0 else 0.2, tp_group=group, megatron_legacy_label_smoothing=True))
    assert outcome == ("Error", "invalid usage: ranks disagree on options.label_smoothing: expected rank 0's 0.1 on "
                                "every rank, got 0.2 on rank 1"), outcome


def check_legacy_flag_disagrees(group, rank, size):
    # The same smoothing, the legacy flag on rank 1 only: the error names the flag.
    logits, target, _ = global_problem(seed=14)
    x = logits[..., rank * (logits.shape[-1] // size):(rank + 1) * (logits.shape[-1] // size)]
    outcome = same_outcome_on_every_rank(group, size, lambda: vt.vocab_parallel_cross_entropy(
        x, target, 0.1, tp_group=group, megatron_legacy_label_smoothing=rank == 1))
    assert outcome == ("Error", "invalid usage: ranks disagree on megatron_legacy_label_smoothing: expected rank "
                                "0's False on every rank, got True on rank 1"), outcome


def check_still_one_collective(group, rank, size):
    # After the failures above the group still agrees on its blocks: one gather, right loss.
    logits, target, grad_loss = global_problem(seed=19, vocab=60)
    local = 60 // size
    with CollectiveCounter() as calls:
        loss = vt.vocab_parallel_cross_entropy(logits[..., rank * local:(rank + 1) * local], target, 0.1,
                                               tp_group=group)
    assert calls.calls == ["all_gather"], calls.calls
    want_loss, _ = loss_and_grad(logits, target, grad_loss, label_smoothing=0.1)
    assert relative_error(loss, want_loss) < 1e-6


def failure_worker(rank, size, init_file, check):
    group = init_group(rank, size, init_file)
    check(group, rank, size)
    check_still_one_collective(group, rank, size)
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3])
def test_a_rank_that_fails_before_the_gather_gives_every_rank_its_error(size):
    spawn(failure_worker, size, check=check_one_rank_fails)


def test_ranks_with_different_token_counts_all_get_the_disagreement():
    spawn(failure_worker, 2, check=check_token_counts_disagree)


def test_ranks_with_different_legacy_smoothing_all_get_the_disagreement():
    spawn(failure_worker, 2, check=check_legacy_smoothing_disagrees)


def test_ranks_that_differ_on_the_legacy_flag_all_get_the_disagreement():
    spawn(failure_worker, 2, check=check_legacy_flag_disagrees)


def regroup_worker(rank, size, init_file):
    # torch.distributed torn down and made again (test suites, in-process restarts): the new
    # group, which has the old one's name, is the one used, on both of vpce's paths.
    logits, target, grad_loss = global_problem(seed=23, vocab=40)
    local = 40 // size
    want_loss, _ = loss_and_grad(logits, target, grad_loss)
    for round_ in range(2):
        group = init_group(rank, size, f"{init_file}.{round_}")
        for inplace in (False, True):
            x = logits[..., rank * local:(rank + 1) * local].clone()
            loss = vt.vocab_parallel_cross_entropy(x, target, 0.0, tp_group=group, inplace_backward=inplace)
            assert relative_error(loss, want_loss) < 1e-6, (round_, inplace)
        dist.destroy_process_group()


def test_a_group_made_again_after_destroy_process_group_is_used():
    spawn(regroup_worker, 2)


def growth_worker(rank, size, init_file):
    # 600 tokens: a 9856-byte payload outgrows the first 4096-byte blocks. The first forward
    # agrees the new size in one extra gather; the next ones make one gather each, and a
    # small call after them (blocks shrunk back) one too.
    group = init_group(rank, size, init_file)
    logits, target, grad_loss = global_problem(seed=17, shape=(600,), vocab=4 * 25)
    local = logits.shape[-1] // size
    x = logits[..., rank * local:(rank + 1) * local]
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss)
    for expected in (["all_gather"] * 2, ["all_gather"]):
        leaf = x.clone().requires_grad_()
        with CollectiveCounter() as calls:
            loss = vt.vocab_parallel_cross_entropy(leaf, target, tp_group=group)
        assert calls.calls == expected, calls.calls
        loss.backward(grad_loss)
        assert relative_error(loss.detach(), want_loss) < 1e-6
        assert relative_error(leaf.grad, want_grad[..., rank * local:(rank + 1) * local]) < 1e-6
    check_case(group, rank, size, torch.float32, 0.0, False, {})  # counts one gather
    dist.destroy_process_group()


def test_payload_that_outgrows_the_blocks_costs_one_more_gather_once():
    spawn(growth_worker, 2)


def default_group_worker(rank, size, init_file):
    # torch.distributed initialised with several ranks, no Megatron, no group passed: tensor
    # or data parallelism? (replicas with the whole vocabulary would get the loss + log R per
    # token). Every function raises a ValueError naming tp_group, with no collective, as
    # Megatron raises when its group is not initialised. The default group passed explicitly
    # is the size-rank loss; a group of one per rank is data parallelism, the whole loss.
    init_group(rank, size, init_file)
    singles = [dist.new_group([r]) for r in range(size)]  # every rank makes every group
    logits, target, grad_loss = global_problem(seed=23)
    local = logits.shape[-1] // size
    begin, end = rank * local, (rank + 1) * local
    assert ((target < begin) | (target >= end)).any()  # targets on the other ranks too
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss)
    generator = torch.Generator().manual_seed(37)
    hidden = torch.randn(*target.shape, 8, generator=generator)
    weight = torch.randn(local, 8, generator=generator)
    ambiguous = [
        lambda x: vt.vocab_parallel_cross_entropy(x, target),
        lambda x: vt.vocab_parallel_cross_entropy(x, target, 0.0, None),
        lambda x: vt.unfused_cross_entropy(x, target),
        lambda x: vt._VocabParallelCrossEntropy.apply(x, target),
        lambda x: vt.fused_vocab_parallel_cross_entropy(x, target, None),
        lambda x: vt.linear_cross_entropy(hidden, weight, target),
        lambda x: vt.linear_cross_entropy(hidden, weight, target, reduction="sum", mode="chunked"),
    ]
    for number, call in enumerate(ambiguous):
        leaf = logits[..., begin:end].clone().requires_grad_()
        with CollectiveCounter() as counted:
            with pytest.raises(ValueError, match=r"tp_group: expected a process group, got None with "
                                                 r"torch.distributed's default group of 2 ranks") as raised:
                call(leaf)
        assert counted.calls == [], (number, counted.calls)
        assert "torch.distributed.group.WORLD" in str(raised.value) and "group of one" in str(raised.value)
    world = dist.group.WORLD
    calls = [
        lambda x: vt.vocab_parallel_cross_entropy(x, target, 0.0, world),
        lambda x: vt.unfused_cross_entropy(x, target, tp_group=world),
        lambda x: vt._VocabParallelCrossEntropy.apply(x, target, 0.0, world),
        lambda x: vt.fused_vocab_parallel_cross_entropy(x, target, world),
    ]
    for number, call in enumerate(calls):
        leaf = logits[..., begin:end].clone().requires_grad_()
        with CollectiveCounter() as counted:
            loss = call(leaf)
        assert counted.calls == ["all_gather"], (number, counted.calls)
        loss.backward(grad_loss)
        assert relative_error(loss.detach(), want_loss) < 1e-6, number
        assert relative_error(leaf.grad, want_grad[..., begin:end]) < 1e-6, number
    # Data parallelism: each replica the whole vocabulary, a group of one: the whole loss.
    replica = logits.clone().requires_grad_()
    loss = vt.vocab_parallel_cross_entropy(replica, target, tp_group=singles[rank])
    loss.backward(grad_loss)
    assert relative_error(loss.detach(), want_loss) < 1e-6
    assert relative_error(replica.grad, want_grad) < 1e-6
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [2])
def test_tp_group_none_with_a_default_group_of_several_ranks_is_refused_without_megatron(size):
    spawn(default_group_worker, size)


def compiled_group_worker(rank, size, init_file):
    # Megatron passes its group explicitly. A group torch.compile traces is a stand-in that
    # cannot run a collective, so the ops must find the real group when they run, even when
    # the first call of the process is the compiled one (no eager call has seen the group).
    group = init_group(rank, size, init_file)
    logits, target, grad_loss = global_problem(seed=29)
    local = logits.shape[-1] // size
    begin, end = rank * local, (rank + 1) * local
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss)
    leaf = logits[..., begin:end].clone().requires_grad_()
    step = torch.compile(lambda x: vt.vocab_parallel_cross_entropy(x, target, 0.0, group), fullgraph=True,
                         backend="aot_eager")
    loss = step(leaf)
    loss.backward(grad_loss)
    assert relative_error(loss.detach(), want_loss) < 1e-6
    assert relative_error(leaf.grad, want_grad[..., begin:end]) < 1e-6
    # The fused head on the same group: hidden replicated, this rank's rows of the weight.
    generator = torch.Generator().manual_seed(31)
    hidden = torch.randn(5, 3, 16, generator=generator, dtype=torch.float64)
    weight = (torch.randn(logits.shape[-1], 16, generator=generator, dtype=torch.float64) / 4).requires_grad_()
    want = torch.nn.functional.cross_entropy((hidden @ weight.T).flatten(0, 1), target.flatten(), reduction="sum")
    want_grad_weight, = torch.autograd.grad(want, weight)
    mine = weight[begin:end].detach().float().requires_grad_()
    head = torch.compile(lambda w: vt.linear_cross_entropy(hidden.float(), w, target, 0.0, group, reduction="sum"),
                         fullgraph=True, backend="aot_eager")
    got = head(mine)
    got.backward()
    assert relative_error(got.detach(), want) < 1e-6
    assert relative_error(mine.grad, want_grad_weight[begin:end]) < 1e-5
    dist.destroy_process_group()


@pytest.mark.skipif(not vt._CUSTOM_OPS, reason="torch.library.custom_op needs PyTorch >= 2.4")
def test_compiled_first_with_an_explicit_group():
    spawn(compiled_group_worker, 2)
