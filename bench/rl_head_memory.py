"""bench/rl_head_memory.py: the RL outputs in the fused head against the same outputs on the
logits, in one run: R gloo processes, hidden [N, H] on every rank and V/R rows of the output
weight, vpce.torch.linear_log_probs_and_entropy (the logits never built) against
h @ W^T then vpce.torch.log_probs_and_entropy, forward and backward with non-uniform upstream
gradients, alternating. Prints per variant the median time, the peak resident memory beyond
the inputs and the gradients of hidden and weight (VmHWM, reset before each call), that peak
as a share of the fp32 logits [N, V/R], the collectives, and the largest difference of
log-prob and entropy between the two (glibc told to unmap freed blocks, so that resident
memory follows the live tensors). A benchmark, not a test.

    build/venv-torch2.15/bin/python bench/rl_head_memory.py --ranks 2 --tokens 4096 --vocab 64000 --hidden 1024
    (--chunk-tokens C: the chunked mode's chunk, with a token block of C below 512)
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from process_memory import reset_peak, status_mib
from rl_compare import Counter


def worker(rank, size, init_file, args, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(args.threads)
    group = dist.new_group(list(range(size)))
    import vpce.torch as vt  # noqa: PLC0415

    local = args.vocab // size
    hidden = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(local, args.hidden, generator=torch.Generator().manual_seed(2 + rank)) / args.hidden ** 0.5
    target = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(7))
    g_lp = torch.rand(args.tokens, generator=torch.Generator().manual_seed(8)) + 0.5
    g_h = torch.rand(args.tokens, generator=torch.Generator().manual_seed(9)) * 0.02 - 0.01

    # Each variant: (what the backward starts from, log_prob, entropy).
    def objective(log_prob, entropy):
        return (log_prob * g_lp + entropy * g_h).sum(), log_prob, entropy

    def head(h, w):
        return objective(*vt.linear_log_probs_and_entropy(h, w, target, tp_group=group))

    # A chunk below the head's default token block (512) takes that block too.
    tiles = {"chunk_tokens": args.chunk_tokens}
    if 0 < args.chunk_tokens < 512:
        tiles["token_block"] = args.chunk_tokens

    def chunked(h, w):
        return vt.linear_policy_objective(h, w, target, g_lp, g_h, tp_group=group, **tiles)

    def logits_path(h, w):
        return objective(*vt.log_probs_and_entropy(h @ w.T, target, tp_group=group))

    runs = {"logits": logits_path, "head": head, "chunked": chunked}
    times, peaks, counts, outputs = ({n: [] for n in runs}, {n: [] for n in runs}, {n: {} for n in runs}, {})
    gradients_mib = (hidden.numel() + weight.numel()) * 4 / 2**20
    for _ in range(args.warmup + args.repeat):
        for name, run in runs.items():
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            dist.barrier()
            reset_peak()
            before = status_mib("VmRSS")
            start = time.perf_counter()
            with Counter() as forward:
                start_from, log_prob, entropy = run(h, w)
            with Counter() as backward:
                start_from.backward()
            times[name].append(time.perf_counter() - start)
            peaks[name].append(status_mib("VmHWM") - before - gradients_mib)
            counts[name] = {"forward": forward.calls, "backward": backward.calls}
            outputs[name] = (log_prob.detach(), entropy.detach())
            del h, w, start_from, log_prob, entropy
    logits_mib = args.tokens * local * 4 / 2**20
    for name in runs:
        lp, ent = outputs[name]
        lp0, ent0 = outputs["logits"]
        results.put((rank, name, statistics.median(times[name][args.warmup:]), max(peaks[name][args.warmup:]),
                     peaks[name][0], logits_mib, counts[name], float((lp - lp0).abs().max()),
                     float((ent - ent0).abs().max())))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=64000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-tokens", type=int, default=0, help="the chunked mode's chunk (0: its default)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    # glibc maps every allocation of 64 KiB or more on its own and unmaps it when freed, so that
    # resident memory follows the live tensors (a freed gradient's pages are not reused unseen).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(worker, args=(args.ranks, os.path.join(directory, "init"), args, results), nprocs=args.ranks)
    order = ("logits", "head", "chunked")
    rows = sorted((results.get() for _ in range(len(order) * args.ranks)), key=lambda r: (r[0], order.index(r[1])))
    print(f"R {args.ranks}, N {args.tokens}, V {args.vocab} ({args.vocab // args.ranks} per rank), H {args.hidden}, "
          f"fp32, {args.threads} thread(s) per rank, chunk_tokens {args.chunk_tokens or 'default'}, median of "
          f"{args.repeat}; rank 0's figures")
    print(f"{'variant':8} {'ms':>9} {'peak MiB':>9} {'% logits':>9} {'first call':>10} {'%':>7} "
          f"{'collectives fwd / bwd':>30} {'log-prob diff':>13} {'entropy diff':>12}")
    for rank, name, ms, peak, first, logits_mib, counts, lp_diff, h_diff in rows:
        if rank != 0:
            continue
        calls = " / ".join(",".join(sorted(set(counts[k]))) or "none" for k in ("forward", "backward"))
        print(f"{name:8} {1e3 * ms:9.1f} {peak:9.1f} {100 * peak / logits_mib:8.2f}% {first:10.1f} "
              f"{100 * first / logits_mib:6.2f}% {calls:>30} {lp_diff:13.2e} {h_diff:12.2e}")
    print(f"(the fp32 logits [N, V/R]: {args.tokens * (args.vocab // args.ranks) * 4 / 2**20:.1f} MiB; the peak beyond "
          "the inputs and the gradients of hidden and weight, over the timed calls and on the first call, which "
          "also holds the buffers a Workspace keeps for the next: the tiles, the head's buffer of logit gradients, "
          "the chunked mode's chunk of logits)")


if __name__ == "__main__":
    main()
