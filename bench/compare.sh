#!/usr/bin/env bash
# Sets up and runs bench/compare.py: builds vpce's shim, makes a virtual environment on
# top of Debian's PyTorch (python3-torch; megatron-core from PyPI needs torch >= 2.6, whose
# PyPI wheels bring the CUDA stack, so Megatron's sequence is written out in compare.py),
# installs what else it needs from PyPI and vpce's Python package, and runs the comparison
# for fp32 and bf16.
# Arguments are passed to compare.py (for example --tokens 4096 --vocab 32000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh >/dev/null
venv=${VPCE_BENCH_VENV:-build/bench-venv}
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check numpy >/dev/null
# vpce's Python package, for the vpce.torch rows.
"$venv/bin/pip" install -q --disable-pip-version-check . --config-settings=build-dir="${VPCE_BUILD_DIR:-build}/python" >/dev/null
for dtype in fp32 bf16; do
  "$venv/bin/python" bench/compare.py --shim "${VPCE_BUILD_DIR:-build}/bench/libvpce_bench_shim.so" --dtype "$dtype" "$@"
done
