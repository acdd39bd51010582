#!/usr/bin/env bash
# Sets up and runs bench/compare.py: builds vpce's shim, makes (once) the virtual
# environment with PyPI's torch 2.15 and the real megatron-core 0.16.1 (scripts/torch-venv.sh;
# VPCE_BENCH_VENV names another, e.g. one on Debian's PyTorch, where Megatron's sequence is
# written out instead), installs vpce's Python package into it, and runs the comparison for
# fp32 and bf16.
# Arguments are passed to compare.py (for example --tokens 4096 --vocab 32000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh >/dev/null
venv=${VPCE_BENCH_VENV:-${VPCE_BUILD_DIR:-build}/venv-torch2.15}
[ -x "$venv/bin/python" ] || scripts/torch-venv.sh "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check numpy >/dev/null
# vpce's Python package, for the vpce.torch rows.
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps . --config-settings=build-dir="${VPCE_BUILD_DIR:-build}/python" >/dev/null
for dtype in fp32 bf16; do
  "$venv/bin/python" bench/compare.py --shim "${VPCE_BUILD_DIR:-build}/bench/libvpce_bench_shim.so" --dtype "$dtype" "$@"
done
