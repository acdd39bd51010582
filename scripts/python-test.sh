#!/usr/bin/env bash
# The Python package: `pip install .` into a fresh virtual environment with nothing but
# NumPy and pytest (the DLPack API without PyTorch), then into one that also sees Debian's
# PyTorch (python3-torch, CPU), and pytest in each.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
python=/usr/bin/python3  # Debian's, whose site-packages hold python3-torch
build=${VPCE_BUILD_DIR:-build}

fresh="$build/venv-fresh"
rm -rf "$fresh"
"$python" -m venv "$fresh"
"$fresh/bin/pip" install --quiet --disable-pip-version-check . numpy pytest --config-settings=build-dir="$build/python"
"$fresh/bin/python" -m pytest -q bindings/python/tests/test_numpy_dlpack.py

with_torch="$build/venv"
rm -rf "$with_torch"
"$python" -m venv --system-site-packages "$with_torch"
"$with_torch/bin/pip" install --quiet --disable-pip-version-check . --config-settings=build-dir="$build/python"
"$with_torch/bin/python" -m pytest -q bindings/python/tests
