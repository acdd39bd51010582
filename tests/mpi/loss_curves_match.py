#!/usr/bin/env python3
"""tests/mpi/loss_curves_match.py: the bigram example trained on R = 1 and on R = RANKS MPI
ranks must print the same loss curve within 1e-5 (and the model must learn something).

usage: loss_curves_match.py RANKS -- MPIRUN_AND_FLAGS... -- TRAIN_COMMAND..."""
import re
import subprocess
import sys


def curve(command):
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stdout}\n{done.stderr}")
    losses = [float(m.group(1)) for m in re.finditer(r"^step +\d+ +loss +(\S+)$", done.stdout, re.M)]
    if not losses:
        sys.exit(f"no 'step k loss x' lines in the output of {' '.join(command)}:\n{done.stdout}")
    return losses


def main():
    ranks = sys.argv[1]
    rest = sys.argv[3:]
    split = rest.index("--")
    mpirun, train = rest[:split], rest[split + 1:]
    one = curve(mpirun + ["1"] + train)
    many = curve(mpirun + [ranks] + train)
    if len(one) != len(many):
        sys.exit(f"R = 1 printed {len(one)} steps, R = {ranks} printed {len(many)}")
    worst = max(abs(a - b) for a, b in zip(one, many))
    print(f"{len(one)} steps; loss {one[0]:.6f} -> {one[-1]:.6f}; largest difference R = 1 vs R = {ranks}: {worst:.3g}")
    if worst > 1e-5:
        sys.exit(f"the loss curves differ by {worst:.3g} > 1e-5")
    if not one[-1] < one[0] - 1.0:
        sys.exit(f"the model did not learn: loss {one[0]} -> {one[-1]}")


if __name__ == "__main__":
    main()
