#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (AddressSanitizer and UndefinedBehaviorSanitizer)
# and runs each for ${VPCE_FUZZ_SECONDS:-60} seconds from the seed corpus in fuzz/corpus.
# Any crash or sanitizer report fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${VPCE_FUZZ_BUILD_DIR:-build-fuzz}
CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVPCE_BUILD_FUZZERS=ON \
  -DVPCE_BUILD_TESTS=OFF -DVPCE_WITH_OPENMP=OFF -DVPCE_WITH_MPI=OFF -DVPCE_WITH_CUDA=OFF -DVPCE_SANITIZE=address,undefined >/dev/null
cmake --build "$build" -j "$(nproc)" --target npy_fuzzer api_fuzzer differential_fuzzer
for target in npy api differential; do
  work="$build/corpus-$target"
  mkdir -p "$work"
  echo "fuzz: ${target}_fuzzer for ${VPCE_FUZZ_SECONDS:-60} s"
  "$build/fuzz/${target}_fuzzer" -max_total_time="${VPCE_FUZZ_SECONDS:-60}" -timeout=60 -print_final_stats=1 \
    -max_len=4096 -artifact_prefix="$build/" "$work" "fuzz/corpus/$target" 2>&1 | tail -n 12
done
echo "fuzz: no crash, no sanitizer report"
