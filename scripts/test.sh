#!/usr/bin/env bash
# The whole test suite: sets up, builds, runs every test with ctest, then the Python
# package's (pip install . and pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
(cd "${VPCE_BUILD_DIR:-build}" && ctest --output-on-failure -j "$(nproc)")
scripts/python-test.sh
