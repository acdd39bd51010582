"""tests/torch_semantics_test.py: `vpce run --smoothing-semantics pytorch` reproduces
torch.nn.functional.cross_entropy(label_smoothing=a, ignore_index=i, reduction=r), loss and
gradient, on float64 PyTorch, for several ranks, smoothing values, ignore indices and
reductions. Run by ctest with the vpce program's path as the only argument."""
import itertools
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

VPCE = sys.argv[1]
S, B, V = 5, 3, 50


def run_vpce(directory, logits, targets, grad_output, ranks, smoothing, ignore_index, reduction):
    np.save(os.path.join(directory, "logits.npy"), logits)
    np.save(os.path.join(directory, "targets.npy"), targets)
    np.save(os.path.join(directory, "grad.npy"), grad_output)
    out = os.path.join(directory, "out")
    subprocess.run([VPCE, "run", "--logits", os.path.join(directory, "logits.npy"),
                    "--targets", os.path.join(directory, "targets.npy"),
                    "--grad-output", os.path.join(directory, "grad.npy"),
                    "--tp", str(ranks), "--smoothing-semantics", "pytorch",
                    "--label-smoothing", str(smoothing), "--ignore-index", str(ignore_index),
                    "--reduction", reduction, "--out", out], check=True, capture_output=True)
    return np.load(os.path.join(out, "loss.npy")), np.load(os.path.join(out, "grad_logits.npy"))


def torch_reference(logits, targets, grad_output, smoothing, ignore_index, reduction):
    x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    loss = F.cross_entropy(x.reshape(-1, V), torch.tensor(targets.reshape(-1)),
                           label_smoothing=smoothing, ignore_index=ignore_index, reduction=reduction)
    g = torch.tensor(grad_output, dtype=torch.float64)
    loss.backward(g.reshape(loss.shape))
    return loss.detach().numpy().reshape(grad_output.shape if reduction == "none" else ()), x.grad.numpy()


def relative(a, b):
    scale = np.abs(b).max()
    return np.abs(a - b).max() / (scale if scale > 0 else 1.0)


def main():
    rng = np.random.default_rng(7)
    failures = 0
    checked = 0
    with tempfile.TemporaryDirectory() as directory:
        for ranks, smoothing, ignore_index, reduction in itertools.product(
                (1, 2, 4), (0.0, 0.1, 0.3), (-100, 3), ("none", "sum", "mean")):
            logits = (rng.standard_normal((S, B, V)) * 3).astype(np.float32)
            targets = rng.integers(0, V, (S, B)).astype(np.int64)
            targets[rng.random((S, B)) < 0.3] = ignore_index
            grad_output = (rng.random((S, B)) + 0.5).astype(np.float32) if reduction == "none" \
                else np.array(0.75, dtype=np.float32)
            loss, grad = run_vpce(directory, logits, targets, grad_output, ranks, smoothing,
                                  ignore_index, reduction)
            want_loss, want_grad = torch_reference(logits, targets, grad_output, smoothing,
                                                   ignore_index, reduction)
            errors = (relative(loss, want_loss), relative(grad, want_grad))
            checked += 1
            if max(errors) > 1e-6:
                failures += 1
                print(f"FAIL R={ranks} a={smoothing} ignore={ignore_index} {reduction}: "
                      f"loss error {errors[0]:.3g}, grad error {errors[1]:.3g}")
        # Every token ignored: PyTorch's mean is NaN (pytorch/pytorch#116349); vpce's is 0.
        logits = rng.standard_normal((S, B, V)).astype(np.float32)
        targets = np.full((S, B), -100, dtype=np.int64)
        loss, grad = run_vpce(directory, logits, targets, np.array(1.0, dtype=np.float32), 2, 0.1,
                              -100, "mean")
        torch_loss, _ = torch_reference(logits, targets, np.array(1.0, dtype=np.float32), 0.1, -100, "mean")
        checked += 1
        if not (loss == 0.0 and np.all(grad == 0.0) and np.isnan(torch_loss)):
            failures += 1
            print(f"FAIL all ignored: vpce {loss}, torch {torch_loss}")
    print(f"{checked - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
