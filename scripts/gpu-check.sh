#!/usr/bin/env bash
# The GPU check: builds the CUDA tests and the bandwidth sweep for sm_90, runs the tests
# (every CUDA path against the CPU fp64 oracle, the fused head's included), then the sweep
# (tokens 4096-65536, V per rank 32000-256000, fp32 and bf16, as a fraction of a
# device-to-device copy measured in the same run), then the fused head's timing rows (its
# forward + backward and chunked step against the three cuBLAS GEMMs of an unfused step of
# the same shapes). Fits in a few minutes on one H200.
#
#   scripts/gpu-check.sh          build, then run (where the packages of setup.sh are)
#   scripts/gpu-check.sh build    build only, into gpu-bundle/ (binaries, libhwy, libdnnl)
#   scripts/gpu-check.sh run      run gpu-bundle/ (on a GPU machine that has no Debian
#                                 packages: carry gpu-bundle there)
#   scripts/gpu-check.sh debs     download Highway, GoogleTest and oneDNN as .deb files into
#                                 gpu-debs/, for building on an offline GPU machine whose C
#                                 library is too old for gpu-bundle/: carry gpu-debs, then
#                                 `scripts/gpu-check.sh` there unpacks and uses them.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
bundle=gpu-bundle

if [ "$mode" = debs ]; then
  rm -rf gpu-debs && mkdir -p gpu-debs
  (cd gpu-debs && apt-get download libhwy-dev libhwy1 libgtest-dev libdnnl-dev libdnnl2)
  exit 0
fi
if [ "$mode" = all ] && [ -d gpu-debs ]; then
  prefix=/tmp/vpce-gpu-prefix
  for f in gpu-debs/*.deb; do dpkg -x "$f" "$prefix"; done
  export CMAKE_PREFIX_PATH="$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

if [ "$mode" = all ] || [ "$mode" = build ]; then
  build=${VPCE_GPU_BUILD_DIR:-build-gpu}
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DVPCE_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DVPCE_WITH_MPI=OFF -DVPCE_BUILD_TOOLS=OFF -DVPCE_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$build" -j "$(nproc)" --target vpce_cuda_tests vpce_cuda_perf vpce_cuda_head_perf
  rm -rf "$bundle" && mkdir -p "$bundle"
  cp "$build/tests/vpce_cuda_tests" "$build/bench/vpce_cuda_perf" "$build/bench/vpce_cuda_head_perf" "$bundle/"
  # The shared libraries a bare CUDA machine lacks (Highway, and oneDNN for the CPU head);
  # cuBLAS comes with the CUDA toolkit there.
  for lib in $(ldd "$bundle/vpce_cuda_tests" | awk '/libhwy|libdnnl/ {print $3}'); do cp "$lib" "$bundle/"; done
  echo "gpu-check: built $bundle/ ($(du -sh "$bundle" | cut -f1))"
fi

if [ "$mode" = all ] || [ "$mode" = run ]; then
  # cuBLAS from the machine's CUDA toolkit, wherever its loader path does not name it.
  export LD_LIBRARY_PATH="$PWD/$bundle${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:/usr/local/cuda/lib64:/usr/local/cuda/lib"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
  echo "gpu-check: tests against the CPU fp64 oracle"
  "$bundle/vpce_cuda_tests" --gtest_brief=1
  echo "gpu-check: bandwidth sweep"
  "$bundle/vpce_cuda_perf" 10
  echo "gpu-check: fused head (linear + cross-entropy) vs the unfused step's three GEMMs"
  "$bundle/vpce_cuda_head_perf" 10
fi
