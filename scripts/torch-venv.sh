#!/usr/bin/env bash
# Makes the virtual environment for the Python tests on today's PyTorch: PyPI's torch 2.15.0
# (its CUDA wheel, which imports on a machine without a GPU; the CUDA libraries it does not
# bring come from the toolkit under /usr/local/cuda) and the real megatron-core 0.16.1, with
# pytest, and verl 0.9.1 without its dependencies (the RL peer: its tensor-parallel functions
# need only torch and megatron-core). About 2 GB, so it is made once and kept: a venv at the path that already imports
# those versions is used as it is. Usage: scripts/torch-venv.sh VENV_DIR
# pip's dependency-resolver warnings (megatron-core's requirements against the --no-deps
# torch) are expected and harmless.
set -euo pipefail
venv=${1:?usage: scripts/torch-venv.sh VENV_DIR}
torch_version=2.15.0
megatron_version=0.16.1
verl_version=0.9.1
# Whether the venv imports those versions (with verl too when $1 is "verl").
matches() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$torch_version" "$megatron_version" "$verl_version" "$1" \
    2>/dev/null <<'PY'
import sys
import importlib.metadata as m
import pytest  # noqa: F401
assert m.version("torch").split("+")[0] == sys.argv[1] and m.version("megatron-core") == sys.argv[2]
assert sys.argv[4] != "verl" or m.version("verl") == sys.argv[3]
import torch, megatron.core  # noqa: F401, E401
PY
}
if matches verl; then
  exit 0
fi
if matches without-verl; then  # a venv made before verl joined it
  "$venv/bin/pip" install --quiet --disable-pip-version-check --progress-bar off --no-deps "verl==$verl_version"
  exit 0
fi
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check --progress-bar off)
"${pip[@]}" --no-deps "torch==$torch_version"
"${pip[@]}" numpy filelock sympy networkx jinja2 fsspec typing-extensions nvidia-cufile nvidia-cusparselt-cu13 \
  "nvidia-nvshmem-cu13==3.7.2" nvidia-nccl-cu13 pytest
"${pip[@]}" "megatron-core==$megatron_version"
"${pip[@]}" --no-deps "verl==$verl_version"
"$venv/bin/python" -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
