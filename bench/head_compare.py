"""bench/head_compare.py: the output layer and its loss, side by side on the same inputs,
the same machine, the same threads, in one run: PyTorch's F.linear + F.cross_entropy (the
logits built, upcast to fp32 as users do), PyTorch's F.linear_cross_entropy (PyTorch
>= 2.15: its reference path, options=None, and its chunked path with each of the choices
of torch.nn.LinearCrossEntropyOptions: the defaults, acc_policy "accurate" and "compact",
chunking_method "aspect_ratio:4", a fixed batch_chunk_size, allow_retain_graph, acc_dtype
float32), vpce's unfused path (F.linear, then vpce.torch.vocab_parallel_cross_entropy on the
built logits), and vpce's fused head, vpce.torch.linear_cross_entropy, in its two modes
(recompute and chunked; with bf16 inputs also with bf16_logit_gradients, the logits'
gradient rounded to bf16 as PyTorch's bf16 paths do). One rank; every case is the mean loss of [tokens, H] hidden
states through a [V, H] weight (no bias), forward and backward, gradients of both.

Method. Each case runs in a fresh Python process, so that its memory is its own, with
torch.set_num_threads(--threads) (vpce's kernels take the same number). Time: the median
wall-clock time (and process CPU time) of --repeat forward+backward calls after --warmup,
over --rounds rounds, each round running every case once in a fresh process, the cases
interleaved (the order rotated each round) so that a slow spell of a shared machine falls on
all of them alike. Memory: Python's
tracemalloc does not see PyTorch's allocations, and PyTorch's CPU allocator keeps no
statistics of its own, so the peak is the operating system's: before each call the
process's peak resident set (VmHWM) is reset to its current one (Linux: writing 5 to
/proc/self/clear_refs), and the extra peak of the call is VmHWM after it minus VmRSS before
the first call (so that buffers a case keeps between calls count); the table gives the
largest over the timed calls, in MiB and in multiples of the fp32 logits' size
([tokens, V] x 4 bytes). PyTorch's CPU allocator gives large blocks back to
the system when they are freed (glibc's mmap threshold), so what a call allocates and
frees shows in its peak. Accuracy: the difference of the loss from a float64 reference
computed from the same (fp32 or bf16) values, and the gradient of hidden's largest
difference from the float64 one, relative to that gradient's largest element (dh err).

A benchmark, not a test; the numbers depend on the machine and its load. Usage:
  python bench/head_compare.py [--tokens 2048 --hidden 512 --vocab 32000 --dtype fp32|bf16]
with vpce's Python package importable (pip install .) and, for the F.linear_cross_entropy
rows, PyTorch >= 2.15 (e.g. the venv of scripts/torch-venv.sh); rows that this PyTorch
cannot run are listed as skipped."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from process_memory import reset_peak, status_mib


def load(directory, name, dtype):
    array = torch.from_numpy(np.load(os.path.join(directory, name + ".npy")))
    return array.view(torch.bfloat16) if dtype == "bf16" and array.dtype == torch.int16 else array


def lce_options(name):
    """The torch.nn.LinearCrossEntropyOptions of an F.linear_cross_entropy case (None for the
    reference path)."""
    choice = name.split(":", 1)[1] if ":" in name else "reference"
    if choice == "reference":
        return None
    options = torch.nn.LinearCrossEntropyOptions
    return {
        "defaults": lambda: options(),
        "accurate": lambda: options(acc_policy="accurate"),
        "compact": lambda: options(acc_policy="compact"),
        "aspect_ratio:4": lambda: options(chunking_method="aspect_ratio:4"),
        "batch_chunk_size=512": lambda: options(chunking_method=None, batch_chunk_size=512),
        "allow_retain_graph": lambda: options(allow_retain_graph=True),
        "acc_dtype=float32": lambda: options(acc_dtype=torch.float32),
    }[choice]()


CASES = [
    ("torch F.linear + F.cross_entropy", "torch-unfused"),
    ("torch F.linear_cross_entropy (options=None)", "lce"),
    ("torch F.linear_cross_entropy (LinearCrossEntropyOptions())", "lce:defaults"),
    ("torch F.linear_cross_entropy (acc_policy='accurate')", "lce:accurate"),
    ("torch F.linear_cross_entropy (acc_policy='compact')", "lce:compact"),
    ("torch F.linear_cross_entropy (chunking_method='aspect_ratio:4')", "lce:aspect_ratio:4"),
    ("torch F.linear_cross_entropy (batch_chunk_size=512)", "lce:batch_chunk_size=512"),
    ("torch F.linear_cross_entropy (allow_retain_graph=True)", "lce:allow_retain_graph"),
    ("torch F.linear_cross_entropy (acc_dtype=torch.float32)", "lce:acc_dtype=float32"),
    ("vpce unfused: F.linear + vocab_parallel_cross_entropy", "vpce-unfused"),
    ("vpce linear_cross_entropy, mode='recompute'", "vpce-recompute"),
    ("vpce linear_cross_entropy, mode='chunked'", "vpce-chunked"),
    ("vpce linear_cross_entropy, 'recompute', bf16_logit_gradients", "vpce-recompute-dx16"),
    ("vpce linear_cross_entropy, 'chunked', bf16_logit_gradients", "vpce-chunked-dx16"),
]


def step(name, hidden, weight, target, threads):
    """One forward and backward of case `name`: (loss, gradients)."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    if name == "torch-unfused":
        logits = F.linear(h, w)
        loss = F.cross_entropy(logits.float(), target)
    elif name.startswith("lce"):
        loss = F.linear_cross_entropy(h, w, target, options=lce_options(name))
    elif name == "vpce-unfused":
        import vpce.torch as vt  # noqa: PLC0415

        logits = F.linear(h, w)
        loss = vt.vocab_parallel_cross_entropy(logits, target, num_threads=threads).mean()
    else:
        import vpce.torch as vt  # noqa: PLC0415

        mode = name.split("-")[1]
        options = {"bf16_logit_gradients": True} if name.endswith("-dx16") else {}
        loss = vt.linear_cross_entropy(h, w, target, mode=mode, reduction="mean", num_threads=threads, **options)
    loss.backward()
    return loss.detach(), (h.grad, w.grad)


def worker(args):
    torch.set_num_threads(args.threads)
    hidden = load(args.input, "hidden", args.dtype)
    weight = load(args.input, "weight", args.dtype)
    target = load(args.input, "target", args.dtype)
    if args.worker.startswith("lce") and not hasattr(F, "linear_cross_entropy"):
        print(json.dumps({"skipped": f"torch {torch.__version__} has no F.linear_cross_entropy"}))
        return 0
    if args.worker.endswith("-dx16") and args.dtype != "bf16":
        print(json.dumps({"skipped": "bf16_logit_gradients takes bf16 inputs (--dtype bf16)"}))
        return 0
    if args.worker.startswith("vpce"):
        import vpce.torch  # noqa: F401, PLC0415 (imported before anything is measured)
    times, cpu_times, peaks = [], [], []
    loss = None
    baseline = status_mib("VmRSS")  # the inputs; what a case keeps between calls counts as extra
    grad_hidden = None
    for _ in range(args.warmup + args.repeat):
        loss = grad_hidden = None
        reset_peak()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss, (grad_hidden, _) = step(args.worker, hidden, weight, target, args.threads)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        peaks.append(status_mib("VmHWM") - baseline)
    reference = float(np.load(os.path.join(args.input, "reference_loss.npy")))
    reference_dh = torch.from_numpy(np.load(os.path.join(args.input, "reference_grad_hidden.npy")))
    dh_error = float((grad_hidden.double() - reference_dh).abs().max() / reference_dh.abs().max())
    print(json.dumps({"ms": [1e3 * t for t in times[args.warmup:]], "cpu_ms": [1e3 * t for t in cpu_times[args.warmup:]],
                      "extra_peak_mb": max(peaks[args.warmup:]), "loss_error": abs(float(loss.double()) - reference),
                      "dh_error": dh_error}))
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per case, the cases interleaved")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case before it is given up")
    parser.add_argument("--only", help="comma-separated case keys (default: all): " +
                        ", ".join(key for _, key in CASES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    cases = CASES if not args.only else [c for c in CASES if c[1] in args.only.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(args.tokens, args.hidden, generator=generator)
        weight = torch.randn(args.vocab, args.hidden, generator=generator) * args.hidden**-0.5 * 2
        target = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
        if args.dtype == "bf16":
            hidden, weight = hidden.bfloat16(), weight.bfloat16()
        for name, tensor in (("hidden", hidden), ("weight", weight), ("target", target)):
            saved = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
            np.save(os.path.join(directory, name + ".npy"), saved.numpy())
        logits = hidden.double() @ weight.double().t()
        reference = F.cross_entropy(logits, target).item()
        np.save(os.path.join(directory, "reference_loss.npy"), np.array(reference))
        # The mean loss's gradient of hidden: (softmax - one-hot) / tokens, times the weight.
        dx = torch.softmax(logits, dim=1)
        del logits
        dx[torch.arange(args.tokens), target] -= 1.0
        dx /= args.tokens
        np.save(os.path.join(directory, "reference_grad_hidden.npy"), (dx @ weight.double()).numpy())
        del dx
        results = {label: {"ms": [], "cpu_ms": [], "extra_peak_mb": 0.0} for label, _ in cases}
        for round_index in range(args.rounds):
            # Every case once per round, in an order rotated by one each round, so that a slow
            # spell of a shared machine falls on all of them alike.
            shift = round_index % len(cases)
            for label, key in cases[shift:] + cases[:shift]:
                if "skipped" in results[label]:
                    continue
                try:
                    out = subprocess.run([sys.executable, __file__, "--worker", key, "--input", directory, "--dtype",
                                          args.dtype, "--threads", str(args.threads), "--repeat", str(args.repeat),
                                          "--warmup", str(args.warmup)], capture_output=True, text=True,
                                         timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    results[label] = {"skipped": f"over --timeout {args.timeout:.0f} s"}
                    continue
                if out.returncode != 0:
                    last = (out.stderr.strip().splitlines() or ["?"])[-1]
                    results[label] = {"skipped": f"failed: {last[:100]}"}
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if "skipped" in r:
                    results[label] = r
                    continue
                merged = results[label]
                merged["ms"] += r["ms"]
                merged["cpu_ms"] += r["cpu_ms"]
                merged["extra_peak_mb"] = max(merged["extra_peak_mb"], r["extra_peak_mb"])
                merged["loss_error"] = r["loss_error"]
                merged["dh_error"] = r["dh_error"]
        for r in results.values():
            if "ms" in r:
                r["ms"], r["cpu_ms"] = statistics.median(r["ms"]), statistics.median(r["cpu_ms"])
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    print(f"# {args.tokens} tokens, H {args.hidden}, V {args.vocab}, {args.dtype} inputs, fp32 logits "
          f"{logits_mb:.0f} MiB; {args.threads} threads; torch {torch.__version__}; median of {args.rounds} rounds x "
          f"{args.repeat} forward+backward (mean loss, gradients of hidden and weight) after {args.warmup} warm-up, "
          "each round a fresh process per case, the cases interleaved")
    print("# extra peak: the largest peak of resident memory beyond the inputs (what a case keeps between calls "
          "counts); cpu ms: the process's CPU time per call, all threads")
    first = next((r for r in results.values() if "ms" in r), None)
    print(f"# {'case':<66} {'fwd+bwd ms':>10} {'vs first':>8} {'cpu ms':>9} {'vs first':>8} {'extra peak MiB':>14} "
          f"{'x logits':>8} {'|loss err|':>10} {'dh err':>8}")
    for label, r in results.items():
        if "ms" not in r:
            print(f"  {label:<66} skipped: {r['skipped']}")
            continue
        print(f"  {label:<66} {r['ms']:10.1f} {first['ms'] / r['ms']:8.2f} {r['cpu_ms']:9.1f} "
              f"{first['cpu_ms'] / r['cpu_ms']:8.2f} {r['extra_peak_mb']:14.0f} {r['extra_peak_mb'] / logits_mb:8.2f} "
              f"{r['loss_error']:10.2e} {r['dh_error']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
