#!/bin/sh
# tests/mpi/stop_rank_one.sh LIBRARY COMMAND...: runs COMMAND on every rank of an mpirun
# job, with LIBRARY preloaded on rank 1 only (stop_after_init: that rank stops itself).
# The rank comes from Open MPI's or MPICH's environment.
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
if [ "$rank" = 1 ]; then
  LD_PRELOAD=$1
  ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0  # a sanitized build: preloaded first
  export LD_PRELOAD ASAN_OPTIONS
fi
shift
exec "$@"
