"""bench/helpers.py: vpce.torch's VocabParallelCrossEntropy static helpers against
megatron-core's (the real package when it imports; otherwise Megatron's torch operations as
vpce's fallback runs them) on the same CPU inputs: the median time of each call, inputs
refilled outside the timing. Prints a table. A benchmark, not a test.

    python bench/helpers.py [--tokens 1024] [--vocab 32000] [--repeat 7]
"""
import argparse
import os
import statistics
import sys
import time

import torch

import vpce.torch as vt


def megatron_helpers():
    try:
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy  # noqa: PLC0415
        return VocabParallelCrossEntropy, "megatron-core"
    except ImportError:
        return None, None


def timed(make, call, repeat):
    times = []
    for _ in range(repeat + 1):
        args = make()
        start = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def cases(tokens, vocab):
    generator = torch.Generator().manual_seed(0)
    x32 = torch.randn(tokens, vocab, generator=generator) * 3
    x16 = x32.to(torch.bfloat16)
    logits_max = x32.max(dim=-1)[0]
    target = torch.randint(0, 2 * vocab, (tokens,), generator=generator)
    sums = torch.rand(tokens) + 1
    predicted = torch.randn(tokens)
    mask = target >= vocab
    grad_output = torch.rand(tokens)
    local = target.masked_fill(mask, 0)
    return [
        ("calculate_logits_max fp32", lambda: (x32,), lambda M: M.calculate_logits_max),
        ("calculate_logits_max bf16", lambda: (x16,), lambda M: M.calculate_logits_max),
        ("calculate_predicted_logits", lambda: (x32.clone(), target, logits_max, 0, vocab),
         lambda M: M.calculate_predicted_logits),
        ("exp_logits_inplace", lambda: (x32.clone(), logits_max), lambda M: getattr(M, "exp_logits_inplace", None)),
        ("gather_predicted_logits", lambda: (x32, target, logits_max, 0, vocab),
         lambda M: getattr(M, "gather_predicted_logits", None)),
        ("calculate_cross_entropy_loss", lambda: (x32.clone(), predicted, sums),
         lambda M: M.calculate_cross_entropy_loss),
        ("prepare_gradient_operands", lambda: (x32, mask), lambda M: M.prepare_gradient_calculation_operands),
        ("scale_gradients_inplace", lambda: (x32.clone(), grad_output),
         lambda M: getattr(M, "scale_gradients_inplace", None)),
        ("calculate_gradients", lambda: (lambda g: (g.view(-1, vocab), torch.arange(tokens), local, 1.0 - mask.float(),
                                                    g, grad_output))(x32.clone()),
         lambda M: M.calculate_gradients),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    megatron, source = megatron_helpers()
    print(f"# {args.tokens} rows x {args.vocab} columns (fp32 {args.tokens * args.vocab * 4 / 2**20:.0f} MiB), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), {os.cpu_count()} CPUs; "
          f"median of {args.repeat} calls; Megatron: {source or 'not installed'}")
    print(f"# {'helper':<30} {'megatron ms':>12} {'vpce ms':>9} {'megatron/vpce':>14}")
    for name, make, pick in cases(args.tokens, args.vocab):
        vpce_ms = timed(make, pick(vt.VocabParallelCrossEntropy), args.repeat)
        theirs = pick(megatron) if megatron is not None else None
        if theirs is None:
            print(f"  {name:<30} {'(none)':>12} {vpce_ms:9.1f} {'':>14}")
            continue
        megatron_ms = timed(make, theirs, args.repeat)
        print(f"  {name:<30} {megatron_ms:12.1f} {vpce_ms:9.1f} {megatron_ms / vpce_ms:14.2f}")


if __name__ == "__main__":
    sys.exit(main())
