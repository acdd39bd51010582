#!/usr/bin/env bash
# Configures and builds vpce (Release) in ${VPCE_BUILD_DIR:-build}.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${VPCE_BUILD_DIR:-build}
# Open MPI is the MPI backend's default; scripts/mpich-check.sh builds against MPICH.
mpi=()
if [ -x /usr/bin/mpicxx.openmpi ]; then
  mpi=(-DMPI_CXX_COMPILER=/usr/bin/mpicxx.openmpi -DMPIEXEC_EXECUTABLE=/usr/bin/mpirun.openmpi)
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release "${mpi[@]}" >/dev/null
cmake --build "$build" -j "$(nproc)"
