#!/usr/bin/env bash
# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer
# included), and the in-process backend's tests under ThreadSanitizer (built without
# OpenMP, whose runtime ThreadSanitizer cannot see into). Any report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc)
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1

mpi=()  # Open MPI, as scripts/build.sh; its tests run without LeakSanitizer (tests/mpi/CMakeLists.txt)
if [ -x /usr/bin/mpicxx.openmpi ]; then
  mpi=(-DMPI_CXX_COMPILER=/usr/bin/mpicxx.openmpi -DMPIEXEC_EXECUTABLE=/usr/bin/mpirun.openmpi)
fi
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVPCE_SANITIZE=address,undefined -DVPCE_WITH_CUDA=OFF \
  -DVPCE_BUILD_BENCHMARKS=OFF "${mpi[@]}" >/dev/null  # (no test runs a benchmark; the Release build compiles them)
cmake --build build-asan -j "$jobs"
# The install test links an uninstrumented consumer against the instrumented library.
(cd build-asan && ctest --output-on-failure -j "$jobs" -E InstallAndFindPackage)

cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVPCE_SANITIZE=thread -DVPCE_WITH_OPENMP=OFF \
  -DVPCE_BUILD_TOOLS=OFF -DVPCE_WITH_MPI=OFF -DVPCE_WITH_CUDA=OFF >/dev/null
cmake --build build-tsan -j "$jobs" --target vpce_tests
(cd build-tsan && ctest --output-on-failure -j "$jobs" -R "Group|Concurrency|Endurance|Determinism|StagedApi|LabelSmoothing|^Workspace\\.")
