#!/usr/bin/env python3
"""bench/exp_bound_in_cache.py: what an exp-bound machine would show for each dtype's row,
measured on this one in cache (issue 18). One core runs the kernels' passes over a block that
stays in cache, where the arithmetic rather than the memory limits, and the bound's exp
alone; a row's %bound on an exp-bound machine is then

    2 / exp / (1 / statistics + 1 / gradient)

with each term in logits (or exponentials) per second: the bound counts two exponentials per
logit, at the exp's throughput. In place (the gradient over the logits, in their dtype):
fp32, bf16 and fp16; out of place
(bf16>32, fp16>32: the gradient into a separate fp32 buffer, which the kernels stream to
memory with non-temporal stores and the benchmark writes with ordinary ones, so that it stays
in cache).

Each run is one vpce_kernels_bench process, pinned to one core, every benchmark repeated in
random interleaving; the table has a line per run, the medians of its repetitions, so that
runs taken minutes apart can be read side by side (the machine is shared; docs/performance.md).

  python3 bench/exp_bound_in_cache.py [--bench build/bench/vpce_kernels_bench] [--runs 3]
      [--core 1] [--repetitions 6] [--target AVX2] [--best]

--target runs another Highway target's kernels than the CPU's best (AVX2 on an AVX-512 CPU:
the AVX2 code, on this CPU's ports, not an AVX2-only CPU's). --best takes each benchmark's
fastest repetition instead of the median: on a shared host whose neighbours only ever slow a
run down, the fastest is the machine's own speed (use more repetitions then).
"""
import argparse
import json
import statistics
import subprocess
import time

EXP = "BM_Exp/0"
ROWS = [  # (row, statistics, gradient)
    ("fp32", "BM_BlockStats/0/0", "BM_BlockGradient/0/0"),
    ("bf16", "BM_BlockStats/1/0", "BM_BlockGradient/1/1"),
    ("fp16", "BM_BlockStats/2/0", "BM_BlockGradient/2/2"),
    ("bf16>32", "BM_BlockStats/1/0", "BM_BlockGradientInCache/1/0"),
    ("fp16>32", "BM_BlockStats/2/0", "BM_BlockGradientInCache/2/0"),
]


def one_run(bench, core, repetitions, target, best):
    """Median items per second (G/s) of each benchmark in one pinned process."""
    names = sorted({EXP} | {n for _, s, g in ROWS for n in (s, g)})
    pattern = "^(" + "|".join(n + "$" for n in names) + ")"
    out = subprocess.run(
        ["taskset", "-c", str(core), bench, "--benchmark_filter=" + pattern,
         f"--benchmark_repetitions={repetitions}", "--benchmark_enable_random_interleaving=true",
         "--benchmark_min_time=0.2", "--benchmark_format=json"] + ([f"--target={target}"] if target else []),
        check=True, capture_output=True, text=True).stdout
    rates = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("run_type") == "iteration":
            rates.setdefault(b["run_name"], []).append(b["items_per_second"] / 1e9)
    missing = [n for n in names if n not in rates]
    if missing:
        raise SystemExit(f"exp_bound_in_cache: {bench} ran none of {missing}")
    pick = max if best else statistics.median
    return {n: pick(v) for n, v in rates.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", default="build/bench/vpce_kernels_bench")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--repetitions", type=int, default=6)
    parser.add_argument("--target", help="a Highway target to force (AVX3, AVX2, ...); default the CPU's best")
    parser.add_argument("--best", action="store_true", help="each benchmark's fastest repetition, not the median")
    args = parser.parse_args()
    if args.target:
        print(f"# Highway target forced: {args.target}")
    print(f"# G logits/s (Exp: G exponentials/s), {'the fastest' if args.best else 'medians'} of each run's repetitions; %: the row's "
          "bound on an exp-bound machine, 2 / Exp / (1 / Stats + 1 / Grad); '>32': out of place")
    header = f"{'time':>8} {'Exp':>6}" + "".join(f" {'Stats/' + r:>13} {'Grad/' + r:>13}" for r, _, _ in ROWS)
    print(header + "".join(f" {r + ' %':>10}" for r, _, _ in ROWS))
    for _ in range(args.runs):
        m = one_run(args.bench, args.core, args.repetitions, args.target, args.best)
        line = f"{time.strftime('%H:%M:%S', time.gmtime()):>8} {m[EXP]:6.2f}"
        line += "".join(f" {m[s]:13.2f} {m[g]:13.2f}" for _, s, g in ROWS)
        line += "".join(f" {200.0 / m[EXP] / (1.0 / m[s] + 1.0 / m[g]):9.1f}%" for _, s, g in ROWS)
        print(line, flush=True)


if __name__ == "__main__":
    main()
