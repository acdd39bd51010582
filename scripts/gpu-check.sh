#!/usr/bin/env bash
# The GPU check: builds the CUDA tests and the bandwidth sweep for sm_90, runs the tests
# (every CUDA path against the CPU fp64 oracle, the fused head's included), then the sweep
# (tokens 4096-65536, V per rank 32000-256000, fp32 and bf16, as a fraction of a
# device-to-device copy measured in the same run), then the fused head's timing rows (its
# forward + backward and chunked step against the three cuBLAS GEMMs of an unfused step of
# the same shapes). Fits in a few minutes on one H200. A failing step does not stop the
# later ones (the run is rare: every result counts); the exit status is the first failure's.
# Each step's whole log goes to $OUT (the device tool's folder) or gpu-logs/.
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
  (cd gpu-debs && apt-get download libhwy-dev libhwy1 libgtest-dev libdnnl-dev libdnnl2 libxxhash-dev)
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
  cmake --build "$build" -j "$(nproc)" --target vpce_cuda_tests vpce_cuda_nccl_tests vpce_cuda_perf vpce_cuda_head_perf
  rm -rf "$bundle" && mkdir -p "$bundle"
  cp "$build/tests/vpce_cuda_tests" "$build/tests/vpce_cuda_nccl_tests" "$build/bench/vpce_cuda_perf" \
    "$build/bench/vpce_cuda_head_perf" "$bundle/"
  # The shared libraries a bare CUDA machine may lack (Highway; oneDNN for the CPU head, with
  # its OpenMP and OpenCL loaders); cuBLAS comes with the CUDA toolkit there, and NCCL
  # (200 MB) from the machine, found at run time.
  for lib in $(ldd "$bundle/vpce_cuda_tests" | awk '/libhwy|libdnnl|libgomp|libOpenCL/ {print $3}'); do
    cp "$lib" "$bundle/"
  done
  echo "$(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')" \
    >"$bundle/COMMIT"
  echo "gpu-check: built $bundle/ ($(du -sh "$bundle" | cut -f1)) from $(cat "$bundle/COMMIT")"
fi

if [ "$mode" = all ] || [ "$mode" = run ]; then
  # cuBLAS from the machine's CUDA toolkit, wherever its loader path does not name it; NCCL
  # from the toolkit or from PyTorch's wheel.
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null || true)
  export LD_LIBRARY_PATH="$PWD/$bundle${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:/usr/local/cuda/lib64:/usr/local/cuda/lib${nccl:+:$nccl}"
  # Where the toolkit's folders lack one, the CUDA runtime, cuBLAS and NCCL of Python's wheels.
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    if ! ldconfig -p | grep -q "$lib" && ! ls /usr/local/cuda/lib64/"$lib" /usr/local/cuda/lib/"$lib" >/dev/null 2>&1; then
      found=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null |
        xargs -r -n1 -I{} find {}/nvidia -name "$lib" -printf '%h\n' 2>/dev/null | head -1)
      [ -z "$found" ] || LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$found"
    fi
  done
  logs=${OUT:-gpu-logs}
  mkdir -p "$logs"
  echo "gpu-check: bundle built from $(cat "$bundle/COMMIT" 2>/dev/null || echo '(no COMMIT file)')"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
  status=0
  # step NAME COMMAND...: runs it, its whole output into $logs/NAME.log; the first failure's
  # status becomes the script's.
  step() {
    local name=$1 rc=0
    shift
    echo "gpu-check: $name"
    "$@" 2>&1 | tee "$logs/$name.log" || rc=$?
    if [ "$rc" -ne 0 ]; then
      echo "gpu-check: $name FAILED (exit $rc)"
      [ "$status" -ne 0 ] || status=$rc
    fi
  }
  missing=$(ldd "$bundle"/vpce_cuda_tests "$bundle"/vpce_cuda_perf "$bundle"/vpce_cuda_head_perf | grep 'not found' || true)
  if [ -n "$missing" ]; then
    echo "gpu-check: libraries not found: $missing"
    exit 1
  fi
  # One process per test, each under its own time limit: a kernel fault poisons its CUDA
  # context and a hang would take the rest of the run, so neither may cost the other tests.
  isolated() {
    local binary=$1 failed=0 test
    for test in $("$binary" --gtest_list_tests | awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}'); do
      timeout 120 "$binary" --gtest_brief=1 --gtest_filter="$test" || { echo "gpu-check: $test FAILED"; failed=1; }
    done
    return "$failed"
  }
  step tests isolated "$bundle/vpce_cuda_tests"
  if ldd "$bundle/vpce_cuda_nccl_tests" | grep -q 'not found'; then
    echo "gpu-check: NCCL tests not run: $(ldd "$bundle/vpce_cuda_nccl_tests" | grep 'not found')"
  else
    step nccl timeout 120 "$bundle/vpce_cuda_nccl_tests" --gtest_brief=1
  fi
  step bandwidth timeout 240 "$bundle/vpce_cuda_perf" 10
  step head timeout 180 "$bundle/vpce_cuda_head_perf" 10
  # Out-of-bounds and misaligned accesses on a few small tests, where the sanitizer can see
  # the device (it cannot on some virtualised machines: then it says so and this step fails).
  if command -v compute-sanitizer >/dev/null; then
    step memcheck timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$bundle/vpce_cuda_tests" \
      --gtest_brief=1 --gtest_filter='Cuda.EveryOption:Cuda.LongRowsAndAdversarialValues:CudaHead.EveryOptionEveryReduction:CudaHead.DefaultTilesAndOneTile:CudaRlHead.MatchesTheCpuHeadForOneAndTwoRanksInBothModes'
  fi
  exit "$status"
fi
