"""Ranks that differ in one argument at a time, for every keyword and size of every public
function of vpce.torch that makes a collective, on a gloo group of 2 processes: each case
must end on every rank within seconds, either with the same error (same class, same text)
on every rank or, where the argument is this rank's own business (threads, tiles, in
place, the targets' integer type), with the same loss on every rank and a backward that
completes. Also the hostile tester's cases: ranks that differ on sequence_parallel (the
hidden states' gather against the loss's, which once paired them and hung), two Python
threads per rank calling on one group (once a wrong loss without an error), and a group
reused for later calls after every one of those errors."""
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

import vpce.torch as vt
from test_distributed import same_outcome_on_every_rank, spawn

CASE_DEADLINE_S = 10.0  # far below the group's timeout: a case that waits for a collective fails
GROUP_TIMEOUT = datetime.timedelta(seconds=30)
TOKENS, VOCAB, HIDDEN = (4, 2), 32, 8  # V/R = 16 on each of 2 ranks


def init(rank, size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=GROUP_TIMEOUT)
    torch.set_num_threads(1)
    return dist.new_group(list(range(size)), timeout=GROUP_TIMEOUT)


def loss_inputs(rank, size, tokens=TOKENS, columns=None, dtype=torch.float32, target_dtype=torch.int64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*tokens, VOCAB, generator=generator).to(dtype)
    target = torch.randint(0, VOCAB, tokens, generator=generator).to(target_dtype)
    local = VOCAB // size
    columns = local if columns is None else columns
    leaf = logits[..., rank * local:rank * local + columns].contiguous().requires_grad_()
    return leaf * 1, target  # not a leaf, as Megatron's logits (inplace_backward takes them)


def head_inputs(rank, size, tokens=TOKENS, hidden_size=HIDDEN, dtype=torch.float32, sequence_parallel=False,
                bias=True, hidden_grad=True):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(*tokens, hidden_size, generator=generator).to(dtype)
    weight = (torch.randn(VOCAB, hidden_size, generator=generator) * 0.5).to(dtype)
    b = (torch.randn(VOCAB, generator=generator) * 0.3).to(dtype)
    target = torch.randint(0, VOCAB, tokens, generator=generator)
    local = VOCAB // size
    if sequence_parallel:  # this rank's slice of the sequence (dim 0)
        slice_ = tokens[0] // size
        hidden = hidden[rank * slice_:(rank + 1) * slice_]
    rows = slice(rank * local, (rank + 1) * local)
    return (hidden.contiguous().requires_grad_(hidden_grad), weight[rows].contiguous().requires_grad_(),
            b[rows].contiguous().requires_grad_() if bias else None, target)


def loss_step(x, target, *args, **kwargs):
    loss = vt.vocab_parallel_cross_entropy(x, target, *args, **kwargs)
    loss.sum().backward()
    return loss.detach()


def head_step(hidden, weight, bias, target, *args, **kwargs):
    loss = vt.linear_cross_entropy(hidden, weight, target, *args, bias=bias, **kwargs)
    loss.sum().backward()
    return loss.detach()


# (name, what rank 0 calls, what rank 1 calls, expected: "error" or "same"). Each is a
# function of (group, rank, size) returning the loss. Rank 0 always takes the baseline.
def loss_cases():
    def base(**changes):
        def call(group, rank, size):
            kwargs = {"tp_group": group}
            kwargs.update(changes.get("kwargs", {}))
            x, target = loss_inputs(rank, size, **changes.get("inputs", {}))
            return loss_step(x, target, changes.get("label_smoothing", 0.0), **kwargs)
        return call

    plain = base()
    smoothed = base(label_smoothing=0.1)
    yield "loss label_smoothing", plain, base(label_smoothing=0.1), "error"
    yield "loss inplace_backward", plain, base(kwargs={"inplace_backward": True}), "same"
    yield "loss megatron_legacy_label_smoothing", smoothed, base(
        label_smoothing=0.1, kwargs={"megatron_legacy_label_smoothing": True}), "error"
    yield "loss ignore_index", plain, base(kwargs={"ignore_index": 3}), "error"
    yield "loss z_loss_weight", plain, base(kwargs={"z_loss_weight": 1e-3}), "error"
    yield "loss logit_scale", plain, base(kwargs={"logit_scale": 0.5}), "error"
    yield "loss softcap", plain, base(kwargs={"softcap": 5.0}), "error"
    yield "loss valid_vocab_size", plain, base(kwargs={"valid_vocab_size": 30}), "error"
    yield "loss smoothing_semantics", smoothed, base(label_smoothing=0.1, kwargs={"smoothing_semantics": "pytorch"}), \
        "error"
    yield "loss num_threads", plain, base(kwargs={"num_threads": 1}), "same"
    yield "loss tokens", plain, base(inputs={"tokens": (4, 3)}), "error"
    yield "loss vocabulary slice", plain, base(inputs={"columns": 15}), "error"
    yield "loss dtype", plain, base(inputs={"dtype": torch.bfloat16}), "error"
    yield "loss target dtype", plain, base(inputs={"target_dtype": torch.int32}), "same"
    yield "loss target values", plain, base(inputs={"seed": 5}), "error"
    yield "loss a bad label_smoothing", plain, base(label_smoothing=1.5), "error"

    def other(function):
        def call(group, rank, size):
            x, target = loss_inputs(rank, size)
            loss = function(x, target, group)
            loss.sum().backward()
            return loss.detach()
        return call

    megatron = other(lambda x, t, g: vt._VocabParallelCrossEntropy.apply(x, t, 0.0, g))
    yield "unfused_cross_entropy vs the smoothed loss", other(
        lambda x, t, g: vt.unfused_cross_entropy(x, t, tp_group=g)), smoothed, "error"
    yield "fused_vocab_parallel_cross_entropy vs _VocabParallelCrossEntropy", other(
        lambda x, t, g: vt.fused_vocab_parallel_cross_entropy(x, t, g)), megatron, "same"
    yield "_VocabParallelCrossEntropy label_smoothing", megatron, other(
        lambda x, t, g: vt._VocabParallelCrossEntropy.apply(x, t, 0.2, g)), "error"


def head_cases():
    def base(label_smoothing=0.0, inputs=None, **options):
        def call(group, rank, size):
            args = dict(inputs or {})
            if options.get("sequence_parallel"):
                args["sequence_parallel"] = True
            hidden, weight, bias, target = head_inputs(rank, size, **args)
            return head_step(hidden, weight, bias, target, label_smoothing, group, **options)
        return call

    plain = base()
    summed = base(reduction="sum")
    chunked = base(reduction="sum", mode="chunked")
    yield "head label_smoothing", plain, base(0.1), "error"
    yield "head sequence_parallel", plain, base(sequence_parallel=True), "error"
    yield "head sequence_parallel (chunked)", chunked, base(reduction="sum", mode="chunked", sequence_parallel=True), \
        "error"
    yield "head mode", summed, chunked, "error"
    yield "head reduction", plain, summed, "error"
    yield "head token_block", plain, base(token_block=2), "same"
    yield "head vocab_block", plain, base(vocab_block=4), "same"
    yield "head chunk_tokens", chunked, base(reduction="sum", mode="chunked", chunk_tokens=2), "error"
    yield "head bf16_logit_gradients on float32", plain, base(bf16_logit_gradients=True), "error"
    yield "head bf16_logit_gradients on bfloat16", base(inputs={"dtype": torch.bfloat16}), base(
        inputs={"dtype": torch.bfloat16}, bf16_logit_gradients=True), "same"
    yield "head gradient_accumulation_fusion", plain, base(gradient_accumulation_fusion=True), "same"
    yield "head vocab_range", plain, base(vocab_range=(16, 32, 33)), "error"
    yield "head num_threads", plain, base(num_threads=1), "same"
    yield "head ignore_index", plain, base(ignore_index=3), "error"
    yield "head z_loss_weight", plain, base(z_loss_weight=1e-3), "error"
    yield "head logit_scale", plain, base(logit_scale=0.5), "error"
    yield "head softcap", plain, base(softcap=5.0), "error"
    yield "head valid_vocab_size", plain, base(valid_vocab_size=30), "error"
    yield "head smoothing_semantics", base(0.1), base(0.1, smoothing_semantics="pytorch"), "error"
    yield "head hidden size", plain, base(inputs={"hidden_size": HIDDEN + 1}), "error"
    yield "head tokens", plain, base(inputs={"tokens": (4, 3)}), "error"
    yield "head dtype", plain, base(inputs={"dtype": torch.bfloat16}), "error"
    yield "head bias", plain, base(inputs={"bias": False}), "same"
    yield "head hidden.requires_grad", plain, base(inputs={"hidden_grad": False}), "error"
    yield "head an unknown option", plain, base(colour="red"), "error"


def the_testers_sequence_parallel_case(group, rank, size):
    # s=2, b=1, H=104: rank 0's hidden-state payload is as long as rank 1's loss payload.
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 1, 104, generator=generator)
    weight = torch.randn(VOCAB // size, 104, generator=generator)
    target = torch.randint(0, VOCAB, (2, 1), generator=generator)
    sequence_parallel = rank == 0
    h = hidden[:1] if sequence_parallel else hidden
    return vt.linear_cross_entropy(h.requires_grad_(), weight, target, 0.0, group, sequence_parallel=sequence_parallel)


def run_case(group, rank, size, name, mine, expected):
    start = time.monotonic()
    result = {}

    def call():
        result["loss"] = mine(group, rank, size)

    kind, text = same_outcome_on_every_rank(group, size, call)
    elapsed = time.monotonic() - start
    assert elapsed < CASE_DEADLINE_S, f"{name}: took {elapsed:.1f} s"
    if expected == "error":
        assert kind and text, f"{name}: expected the same error on every rank, got none"
    else:
        assert (kind, text) == ("", ""), f"{name}: expected a loss, got {kind}: {text}"
        losses = [torch.empty_like(result["loss"]) for _ in range(size)]
        dist.all_gather(losses, result["loss"], group=group)
        assert all(torch.equal(other, losses[0]) for other in losses), f"{name}: the ranks' losses differ"
    return kind, text


def fuzz_worker(rank, size, init_file, which):
    group = init(rank, size, init_file)
    cases = list(loss_cases()) if which == "loss" else list(head_cases())
    for name, baseline, variant, expected in cases:
        kind, text = run_case(group, rank, size, name, variant if rank == 1 else baseline, expected)
        if name.endswith("sequence_parallel") or name.endswith("sequence_parallel (chunked)"):
            assert text == ("invalid usage: ranks disagree on sequence_parallel: expected rank 0's False on every "
                            "rank, got True on rank 1"), text
        # The group is sound after each case: the baseline gives the same loss everywhere.
        run_case(group, rank, size, name + ", then the baseline again", baseline, "same")
    if which == "head":
        kind, text = run_case(group, rank, size, "the tester's case", the_testers_sequence_parallel_case, "error")
        assert "ranks disagree on sequence_parallel" in text, text
    dist.destroy_process_group()


@pytest.mark.parametrize("which", ["loss", "head"])
def test_ranks_that_differ_in_one_argument_get_the_same_error_or_the_same_loss_at_once(which):
    spawn(fuzz_worker, 2, which=which)


def threads_worker(rank, size, init_file):
    # 2 threads per rank, each with its own data, on the same group: every call returns its
    # own correct loss or raises; none returns a wrong loss, and every call ends.
    group = init(rank, size, init_file)
    outcomes = {"right": 0, "errors": 0, "wrong": 0}
    lock = threading.Lock()

    def thread_body(index):
        for call in range(10):
            x, target = loss_inputs(rank, size, seed=100 * index + call)
            full, _ = loss_inputs(0, 1, seed=100 * index + call)
            want = torch.nn.functional.cross_entropy(full.detach().double().flatten(0, -2), target.flatten(),
                                                     reduction="none").view(target.shape)
            try:
                loss = vt.vocab_parallel_cross_entropy(x, target, tp_group=group)
                key = "right" if (loss.double() - want).abs().max().item() < 1e-5 else "wrong"
            except Exception as error:  # noqa: BLE001 (any error is an acceptable outcome here)
                assert "vpce" in type(error).__module__ or "tp_group" in str(error) or "disagree" in str(error), error
                key = "errors"
            with lock:
                outcomes[key] += 1

    start = time.monotonic()
    threads = [threading.Thread(target=thread_body, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start < 30, "the threads' calls took too long"
    assert outcomes["wrong"] == 0, outcomes
    assert outcomes["right"] + outcomes["errors"] == 20, outcomes
    # The group still works for a single thread afterwards.
    run_case(group, rank, size, "one thread again", lambda g, r, s: loss_step(*loss_inputs(r, s), tp_group=g),
             "same")
    dist.destroy_process_group()


def test_two_threads_on_one_group_never_get_a_wrong_loss():
    spawn(threads_worker, 2)
