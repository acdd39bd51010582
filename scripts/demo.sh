#!/usr/bin/env bash
# The main job: sets up, builds, generates a 4096-token, V = 32000 example and runs
# `vpce run` on it with R = 4 in-process ranks, printing the summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh >/dev/null
build=${VPCE_BUILD_DIR:-build}
example="$build/example"
"$build/tools/vpce" gen --tokens 4096 --vocab 32000 --seed 1 --out "$example"
"$build/tools/vpce" run --logits "$example/logits.npy" --targets "$example/targets.npy" \
  --tp 4 --label-smoothing 0.1 --out "$example/out"
