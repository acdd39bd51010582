"""vpce.torch on real torch.distributed groups: 1, 2 and 4 processes over gloo, each holding
its shard of the vocabulary, against the float64 PyTorch reference; exactly one collective
per forward and none per backward, counted; the same loss on every rank; ranks that
disagree get the same error; Megatron's legacy smoothing reproduced on request."""
import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vpce
import vpce.torch as vt
from reference import loss_and_grad, megatron_legacy, relative_error

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce", "reduce_scatter",
               "barrier", "gather", "scatter", "all_to_all", "send", "recv", "isend", "irecv")


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


def worker(rank, size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    group = dist.new_group(list(range(size)))  # a group object, as Megatron passes
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
    if size > 1:
        check_legacy(group, rank, size)
        check_disagreement(group, rank, size)
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_gloo_group(size):
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(functools.partial(worker, size=size, init_file=os.path.join(directory, "init")), nprocs=size,
                 join=True)
