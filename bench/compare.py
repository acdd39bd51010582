"""bench/compare.py: vpce side by side with what users run today, on the same inputs, on
the same machine, in one run: PyTorch's F.cross_entropy forward and backward (with the
fp32 upcast users do), Megatron-LM's vocab_parallel_cross_entropy for one rank (the real
megatron-core if it imports, unfused and its native fused branch, on a gloo group of one
rank; otherwise its sequence of tensor operations written out as in
megatron/core/tensor_parallel/cross_entropy.py), and vpce (its C++ API through a shim,
and vpce.torch with a new gradient and in place). Each runs in a fresh process
so that its peak memory is its own; prints the median time, the ratios, the peak memory
beyond the inputs, and the largest loss difference from a float64 reference.

Run through bench/compare.sh, which sets up the environment. A benchmark, not a test."""
import argparse
import ctypes
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


def load_inputs(directory, dtype):
    """The logits as saved: float32, or bfloat16 bits saved as int16 (no fp32 detour)."""
    logits = torch.from_numpy(np.load(os.path.join(directory, "logits.npy")))
    if dtype == "bf16":
        logits = logits.view(torch.bfloat16)
    targets = torch.from_numpy(np.load(os.path.join(directory, "targets.npy")))
    return logits, targets


def run_pytorch(logits, targets):
    """What users write: upcast to fp32, F.cross_entropy, backward into the logits' dtype."""
    x = logits.detach().requires_grad_(True)
    loss = F.cross_entropy(x.float(), targets, reduction="none")
    loss.backward(torch.ones_like(loss))
    return loss.detach(), x.grad


class MegatronSequence(torch.autograd.Function):
    """Megatron-LM's _VocabParallelCrossEntropy for one rank, its tensor operations written
    out (the all-reduces over a group of one rank are identities)."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        vocab_parallel_logits = vocab_parallel_logits.float()
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        target_mask = (target < 0) | (target >= partition_vocab_size)
        masked_target = target.clone()
        masked_target[target_mask] = 0
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].clone().contiguous().view_as(target)
        predicted_logits[target_mask] = 0.0
        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax
        partition_vocab_size = softmax.size()[-1]
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None


_MEGATRON = {}


def megatron_core():
    """(vocab_parallel_cross_entropy, fused_vocab_parallel_cross_entropy, tp group) of the real
    megatron-core on a gloo world of one rank with parallel_state initialised; None when it
    does not import (PyTorch < 2.6)."""
    if "state" not in _MEGATRON:
        try:
            import torch.distributed as dist  # noqa: PLC0415
            from megatron.core import parallel_state  # noqa: PLC0415
            from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy  # noqa: PLC0415
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: PLC0415
        except ImportError:
            _MEGATRON["state"] = None
            return None
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        _MEGATRON["state"] = (vocab_parallel_cross_entropy, fused_vocab_parallel_cross_entropy,
                              parallel_state.get_tensor_model_parallel_group())
    return _MEGATRON["state"]


def run_megatron(logits, targets, scratch=None, fused=False):
    """megatron-core's own function when it imports (its forward overwrites fp32 logits, so
    they are `scratch`, refilled by the caller outside the timing, as the LM head's output
    would be); otherwise its sequence of tensor operations written out."""
    state = megatron_core()
    if state is None:
        x = logits.detach().requires_grad_(True)
        loss = MegatronSequence.apply(x, targets)
        loss.backward(torch.ones_like(loss))
        return loss.detach(), x.grad
    unfused, fused_function, group = state
    x = scratch.detach().requires_grad_(True)
    loss = fused_function(x, targets, group) if fused else unfused(x, targets)
    (grad,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    return loss.detach(), grad


def run_vpce(logits, targets, shim, threads, in_place, buffer=None):
    """In place: the gradient overwrites `buffer` (a copy of the logits refilled by the caller
    outside the timing). Otherwise into `buffer` if given (kept between calls), else into a
    new fp32 gradient, as an autograd function on the CPU would allocate."""
    tokens, vocab = logits.shape
    x = buffer if in_place else logits
    code = 0 if x.dtype == torch.float32 else 1
    loss = torch.empty(tokens, dtype=torch.float32)
    lse = torch.empty(tokens, dtype=torch.float64)
    ones = torch.ones(tokens, dtype=torch.float32)
    grad = None if in_place else (buffer if buffer is not None else torch.empty(tokens, vocab, dtype=torch.float32))
    error = ctypes.create_string_buffer(512)
    rc = shim.vpce_bench_forward_backward(
        ctypes.c_void_p(x.data_ptr()), code, tokens, vocab, ctypes.c_void_p(targets.data_ptr()),
        ctypes.c_void_p(ones.data_ptr()), ctypes.c_void_p(loss.data_ptr()), ctypes.c_void_p(lse.data_ptr()),
        ctypes.c_void_p(grad.data_ptr() if grad is not None else 0), int(in_place), threads, error, 512)
    if rc != 0:
        raise RuntimeError(error.value.decode())
    return loss, (x if in_place else grad)


class Output(torch.autograd.Function):
    """The identity, whose result is an operation's output sharing the input's memory."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty(0)
        return out.set_(x)  # the same memory, not a view autograd knows of

    @staticmethod
    def backward(ctx, grad):
        return grad


def run_vpce_torch(logits, targets, in_place, scratch=None):
    """vpce's Python package (vpce.torch), as a Megatron user would call it: an autograd
    function; in place, the gradient overwrites the logits (`scratch`, refilled by the
    caller outside the timing), as Megatron's does."""
    import vpce.torch as vt  # noqa: PLC0415 (only in the workers that need it)
    x = (scratch if in_place else logits).detach().requires_grad_(True)
    # In place, the logits must be an operation's output (the LM head's in a model): an
    # identity autograd function makes one without a copy.
    loss = vt.vocab_parallel_cross_entropy(Output.apply(x) if in_place else x, targets, inplace_backward=in_place)
    # The gradient goes on to the LM head's backward, as in a model: autograd.grad hands it
    # over (backward() into a leaf's .grad would copy a gradient that aliases the leaf).
    (grad,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    return loss.detach(), grad


def megatron_available():
    try:
        import megatron.core.fusions.fused_cross_entropy  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def megatron_version():
    import megatron.core  # noqa: PLC0415
    return megatron.core.__version__


def have_vpce_package():
    try:
        import vpce.torch  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def worker(args):
    torch.set_num_threads(args.threads)
    logits, targets = load_inputs(args.input, args.dtype)
    in_place = args.worker.endswith("in-place")
    overwrites = in_place or args.worker.startswith("megatron")
    if args.worker.startswith("megatron"):
        megatron_core()  # set up outside the measurement
    scratch = logits.clone() if overwrites else None  # refilled before each timed call
    reused = torch.empty(logits.shape, dtype=torch.float32) if args.worker == "vpce-reused" else None
    if reused is not None:
        reused.zero_()  # a buffer kept from call to call, as a framework's allocator would
    reset_peak()
    baseline = status_mib("VmRSS")
    shim = None
    if args.worker.startswith("vpce-") or args.worker == "vpce":
        shim = ctypes.CDLL(args.shim)
        shim.vpce_bench_forward_backward.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    runs = {
        "pytorch": lambda: run_pytorch(logits, targets),
        "megatron": lambda: run_megatron(logits, targets, scratch),
        "megatron-fused": lambda: run_megatron(logits, targets, scratch, fused=True),
        "vpce": lambda: run_vpce(logits, targets, shim, args.threads, False),
        "vpce-reused": lambda: run_vpce(logits, targets, shim, args.threads, False, reused),
        "vpce-in-place": lambda: run_vpce(logits, targets, shim, args.threads, True, scratch),
        "vpce.torch": lambda: run_vpce_torch(logits, targets, False),
        "vpce.torch-in-place": lambda: run_vpce_torch(logits, targets, True, scratch),
    }
    run = runs[args.worker]
    times = []
    peaks = []
    loss = None
    for _ in range(args.warmup + args.repeat):
        if scratch is not None:
            scratch.copy_(logits)  # the gradient overwrote it
        loss = None
        reset_peak()  # per call: the peak beyond what was resident just before it
        before = status_mib("VmRSS")
        start = time.perf_counter()
        loss, grad = run()
        times.append(time.perf_counter() - start)
        peaks.append(status_mib("VmHWM") - before)
        del grad
    reference = np.load(os.path.join(args.input, "reference_loss.npy"))
    print(json.dumps({
        "ms": 1e3 * statistics.median(times[args.warmup:]),
        "extra_peak_mb": max(peaks[args.warmup:]),
        "loss_error": float(np.abs(loss.double().numpy() - reference).max()),
    }))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--shim", required=True, help="path to libvpce_bench_shim.so")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as directory:
        rng = np.random.default_rng(0)
        logits = (rng.standard_normal((args.tokens, args.vocab), dtype=np.float32) * 2)
        targets = rng.integers(0, args.vocab, args.tokens).astype(np.int64)
        x = torch.from_numpy(logits)
        if args.dtype == "bf16":
            x = x.to(torch.bfloat16)
        np.save(os.path.join(directory, "logits.npy"), x.view(torch.int16).numpy() if args.dtype == "bf16" else logits)
        np.save(os.path.join(directory, "targets.npy"), targets)
        reference = torch.logsumexp(x.double(), -1) - x.double()[torch.arange(args.tokens), torch.from_numpy(targets)]
        np.save(os.path.join(directory, "reference_loss.npy"), reference.numpy())
        del logits, x
        results = {}
        names = ["pytorch", "megatron"] + (["megatron-fused"] if megatron_available() else []) + [
            "vpce", "vpce-reused", "vpce-in-place"]
        if have_vpce_package():
            names += ["vpce.torch", "vpce.torch-in-place"]
        for name in names:
            out = subprocess.run([sys.executable, __file__, "--worker", name, "--input", directory, "--shim", args.shim,
                                  "--dtype", args.dtype, "--threads", str(args.threads), "--repeat", str(args.repeat),
                                  "--warmup", str(args.warmup)], check=True, capture_output=True, text=True)
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    logits_mb = args.tokens * args.vocab * (4 if args.dtype == "fp32" else 2) / 2**20
    print(f"# {args.tokens} tokens, V {args.vocab}, {args.dtype} logits ({logits_mb:.0f} MiB), {args.threads} threads, "
          f"torch {torch.__version__}; median of {args.repeat} forward+backward after {args.warmup} warm-up")
    print("# vpce: a new fp32 gradient each call; vpce-reused: into a kept fp32 buffer; vpce-in-place: over the logits")
    print("# vpce.torch: the Python package's autograd function (gradient in the logits' dtype; -in-place: over them)")
    print(f"# megatron: {'megatron-core ' + megatron_version() + ' (unfused; -fused: its native fused branch)' if megatron_available() else 'its sequence written out (megatron-core does not import)'}")
    print("# extra peak MiB: the largest per-call peak of resident memory beyond what was resident before the call")
    print(f"# {'implementation':<20} {'fwd+bwd ms':>11} {'pytorch/x':>10} {'megatron/x':>11} {'extra peak MiB':>15} "
          f"{'x logits':>9} {'max |loss err|':>15}")
    for name, r in results.items():
        print(f"  {name:<20} {r['ms']:11.1f} {results['pytorch']['ms'] / r['ms']:10.2f} "
              f"{results['megatron']['ms'] / r['ms']:11.2f} {r['extra_peak_mb']:15.0f} "
              f"{r['extra_peak_mb'] / logits_mb:9.2f} {r['loss_error']:15.2e}")


if __name__ == "__main__":
    sys.exit(main())
