"""bench/new_gradient.py: vpce's backward into a new gradient tensor, allocated by PyTorch's
allocator (torch.empty_like: glibc's heap once its mmap threshold has risen) and as vpce.torch
does (_new_gradient: from 2 MiB, an anonymous mapping of its own on 2 MiB boundaries, advised
onto transparent huge pages), against the backward in place; the shard of rank 0 at TP = 2
(V = 32000, so 16000 columns), fp32, for several token counts. Median ms of the backward
call, allocation included. A benchmark, not a test.

    python bench/new_gradient.py [--repeat 7]
"""
import argparse
import statistics
import sys
import time

import torch

import vpce
import vpce.torch as vt


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    local, vocab = 16000, 32000
    options = vpce.LossOptions()
    print(f"# backward of rank 0 of TP = 2 (16000 of 32000 columns), fp32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeat}")
    print(f"# {'tokens':>7} {'gradient MiB':>13} {'heap new-grad ms':>17} {'mapped new-grad ms':>19} {'in place ms':>12}")
    for tokens in (64, 256, 1024, 2048):
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(tokens, local, generator=generator) * 2
        target = torch.randint(0, vocab, (tokens,), generator=generator)
        lse = torch.logsumexp(logits, -1) + 0.5  # any finite lse: the time does not depend on it
        grad_loss = torch.ones(tokens)
        results = {}
        for name, make in (("heap", torch.empty_like), ("mapped", vt._new_gradient), ("in place", None)):
            times = []
            for _ in range(args.repeat + 1):
                scratch = logits.clone() if make is None else None
                start = time.perf_counter()
                grad = scratch if make is None else make(logits)
                vpce._vpce.backward(scratch if make is None else logits, target, lse, grad_loss, 0, local, vocab,
                                    options, grad)
                times.append(time.perf_counter() - start)
                del grad, scratch
            results[name] = 1e3 * statistics.median(times[1:])
        mib = tokens * local * 4 / 2**20
        print(f"  {tokens:7d} {mib:13.1f} {results['heap']:17.2f} {results['mapped']:19.2f} {results['in place']:12.2f}")


if __name__ == "__main__":
    sys.exit(main())
