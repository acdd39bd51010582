#!/usr/bin/env bash
# The Python package: built once as a wheel (`pip wheel .`), installed into a fresh virtual
# environment with nothing but NumPy and pytest (the DLPack API without PyTorch), then into
# one that also sees Debian's PyTorch (python3-torch 1.13, CPU), then into one with PyPI's
# torch 2.15 and the real megatron-core (scripts/torch-venv.sh, made once and kept), and
# pytest in each. On torch 2.15 nothing may skip: the custom-op, torch.compile and
# megatron-core tests must run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
python=/usr/bin/python3  # Debian's, whose site-packages hold python3-torch
build=${VPCE_BUILD_DIR:-build}

# One wheel (`pip wheel .`: the same build as `pip install .`), installed into each
# environment: they share the interpreter, and building it once saves two builds.
fresh="$build/venv-fresh"
rm -rf "$fresh"
"$python" -m venv "$fresh"
wheels="$build/wheels"
rm -rf "$wheels"
"$fresh/bin/pip" wheel --quiet --disable-pip-version-check --no-deps . -w "$wheels" \
  --config-settings=build-dir="$build/python"
wheel=$(ls "$wheels"/vpce-*.whl)
"$fresh/bin/pip" install --quiet --disable-pip-version-check "$wheel" numpy pytest
"$fresh/bin/python" -m pytest -q bindings/python/tests/test_numpy_dlpack.py

with_torch="$build/venv"
rm -rf "$with_torch"
"$python" -m venv --system-site-packages "$with_torch"
"$with_torch/bin/pip" install --quiet --disable-pip-version-check "$wheel"
"$with_torch/bin/python" -m pytest -q bindings/python/tests

today="$build/venv-torch2.15"
scripts/torch-venv.sh "$today"
"$today/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel"
log="$build/pytest-torch2.15.log"
"$today/bin/python" -m pytest -q -rs bindings/python/tests 2>&1 | tee "$log"
if grep -qiE "[0-9]+ skipped|^SKIPPED" "$log"; then
  echo "python-test: tests skipped on torch 2.15 (they must run there)" >&2
  exit 1
fi
