"""bench/rl_compare.py: the RL outputs side by side with verl 0.9.1's tensor-parallel pair on
the same inputs, in one run: R gloo processes, each holding V/R columns of N tokens' logits;
verl's log-probabilities (minus megatron-core's vocab_parallel_cross_entropy) and its
_VocabParallelEntropy on a clone of the logits (as verl's Megatron engine calls them), against
vpce.torch.log_probs_and_entropy (one call; a new gradient, and in place), forward and backward with non-uniform
upstream gradients on both outputs, alternating call by call. Prints per variant the median
time of forward + backward, the ratio, the peak resident memory beyond the inputs and the
logits-size gradient (VmHWM, reset before each call), the collectives of the forward and of
the backward, and the largest error of log-prob and entropy (relative to the largest value)
and of the gradient against float64 on the first 256 tokens. A benchmark, not a test.

    build/venv-torch2.15/bin/python bench/rl_compare.py --ranks 2 --tokens 4096 --vocab 64000
"""
import argparse
import importlib.util
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from process_memory import reset_peak, status_mib

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter")


class Counter:
    """Counts torch.distributed's collectives while installed."""

    def __init__(self):
        self.calls, self.saved = [], {}

    def __enter__(self):
        for name in COLLECTIVES:
            original = self.saved[name] = getattr(dist, name)
            setattr(dist, name, lambda *a, _n=name, _o=original, **k: (self.calls.append(_n), _o(*a, **k))[1])
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def load_verl():
    """verl 0.9.1's tensor_parallel module by its path (its package __init__ imports ray)."""
    spec = importlib.util.find_spec("verl")
    path = os.path.join(spec.submodule_search_locations[0], "utils", "megatron", "tensor_parallel.py")
    module_spec = importlib.util.spec_from_file_location("verl_tensor_parallel", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


class _ModelOutput(torch.autograd.Function):
    """Stands for the layer that made the logits: a non-leaf (so the in-place gradient may
    overwrite it) whose backward takes the gradient and passes nothing on."""

    @staticmethod
    def forward(ctx, x, anchor):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None


def model_output(x):
    """The logits as a model's output, made before the peak is reset (an input, not extra)."""
    return _ModelOutput.apply(x, torch.zeros((), requires_grad=True))


def run_verl(verl, logits, target, g_lp, g_h, counts):
    logits.retain_grad()
    with Counter() as forward:
        logits_for_entropy = logits.clone()  # verl's caller: the entropy's in-place ops would spoil the logits
        log_prob = verl.vocab_parallel_log_probs_from_logits(logits, target)
        entropy = verl.vocab_parallel_entropy(logits_for_entropy)
    with Counter() as backward:
        (log_prob * g_lp + entropy * g_h).sum().backward()
    counts.update(forward=forward.calls, backward=backward.calls)
    return log_prob.detach(), entropy.detach(), logits.grad


def run_vpce(vt, logits, target, g_lp, g_h, counts, group, inplace):
    gradient = []
    if not inplace:
        logits.register_hook(lambda g: gradient.append(g))
    with Counter() as forward:
        log_prob, entropy = vt.log_probs_and_entropy(logits, target, tp_group=group, inplace_backward=inplace)
    with Counter() as backward:
        (log_prob * g_lp + entropy * g_h).sum().backward()
    counts.update(forward=forward.calls, backward=backward.calls)
    return log_prob.detach(), entropy.detach(), logits.detach() if inplace else gradient[0]


def reference(full, target, g_lp, g_h):
    x = full.double().requires_grad_(True)
    log_p = torch.log_softmax(x, -1)
    log_prob = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (log_prob * g_lp.double() + entropy * g_h.double()).sum().backward()
    return log_prob.detach(), entropy.detach(), x.grad


def worker(rank, size, init_file, args, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(args.threads)
    import megatron.core.jit as jit  # noqa: PLC0415

    jit.disable_jit_fuser()
    from megatron.core import parallel_state  # noqa: PLC0415

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)
    group = parallel_state.get_tensor_model_parallel_group()
    import vpce.torch as vt  # noqa: PLC0415

    verl = load_verl()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    local = args.vocab // size
    generator = torch.Generator().manual_seed(1234 + rank)
    x = (torch.randn(args.tokens, local, generator=generator) * 2).to(dtype)
    target = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(7))
    g_lp = torch.rand(args.tokens, generator=torch.Generator().manual_seed(8)) + 0.5
    g_h = torch.rand(args.tokens, generator=torch.Generator().manual_seed(9)) * 0.02 - 0.01
    runs = {"verl": lambda logits, c: run_verl(verl, logits, target, g_lp, g_h, c),
            "vpce": lambda logits, c: run_vpce(vt, logits, target, g_lp, g_h, c, group, False),
            "vpce-in-place": lambda logits, c: run_vpce(vt, logits, target, g_lp, g_h, c, group, True)}
    times = {name: [] for name in runs}
    peaks = {name: [] for name in runs}
    counts = {name: {} for name in runs}
    outputs = {}
    grad_mib = x.numel() * x.element_size() / 2**20
    checked = min(256, args.tokens)
    for _ in range(args.warmup + args.repeat):
        for name, run in runs.items():
            logits = model_output(x)
            dist.barrier()
            reset_peak()
            before = status_mib("VmRSS")
            start = time.perf_counter()
            outputs[name] = run(logits, counts[name])
            times[name].append(time.perf_counter() - start)
            # beyond the inputs, and beyond the new logits-size gradient where there is one
            peaks[name].append(status_mib("VmHWM") - before - (0 if name == "vpce-in-place" else grad_mib))
            del logits
            outputs[name] = tuple(t[:checked].clone() for t in outputs[name])
    # float64 on the first 256 tokens (or all, if fewer): every rank's columns gathered
    parts = [torch.empty(checked, local, dtype=dtype) for _ in range(size)]
    dist.all_gather(parts, x[:checked].contiguous())
    want = reference(torch.cat(parts, -1), target[:checked], g_lp[:checked], g_h[:checked])
    for name in runs:
        lp, h, grad = outputs[name]
        want_grad = want[2][:, rank * local:(rank + 1) * local]
        results.put((rank, name, statistics.median(times[name][args.warmup:]), max(peaks[name][args.warmup:]),
                     counts[name], float(((lp.double() - want[0]).abs().max() / want[0].abs().max())),
                     float(((h.double() - want[1]).abs().max() / want[1].abs().max())),
                     float(((grad.double() - want_grad).abs().max() / want_grad.abs().max()))))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=64000, help="the whole vocabulary (each rank V / R)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(worker, args=(args.ranks, os.path.join(directory, "init"), args, results), nprocs=args.ranks)
    rows = [results.get() for _ in range(3 * args.ranks)]
    print(f"R {args.ranks}, N {args.tokens}, V {args.vocab} ({args.vocab // args.ranks} per rank), {args.dtype}, "
          f"{args.threads} thread(s) per rank, median of {args.repeat}; rank 0's figures")
    print(f"{'variant':13} {'ms':>9} {'x verl':>7} {'peak MiB':>9} {'fwd collectives':>24} {'bwd':>5} "
          f"{'log-prob err':>12} {'entropy err':>12} {'grad err':>10}")
    verl_ms = next(r[2] for r in rows if r[0] == 0 and r[1] == "verl")
    for rank, name, ms, peak, counts, lp_err, h_err, g_err in sorted(rows, key=lambda r: (r[0], r[1] != "verl")):
        if rank != 0:
            continue
        fwd = ",".join(f"{counts['forward'].count(c)} {c}" for c in sorted(set(counts["forward"])))
        print(f"{name:13} {1e3 * ms:9.1f} {verl_ms / ms:7.2f} {peak:9.1f} {fwd:>24} {len(counts['backward']):5d} "
              f"{lp_err:12.2e} {h_err:12.2e} {g_err:10.2e}")
    logits_mib = args.tokens * (args.vocab // args.ranks) * (2 if args.dtype == "bf16" else 4) / 2**20
    print(f"(the logits shard: {logits_mib:.1f} MiB; peak beyond the inputs and the one logits-size gradient)")


if __name__ == "__main__":
    main()
