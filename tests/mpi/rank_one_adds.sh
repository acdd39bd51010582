#!/bin/sh
# tests/mpi/rank_one_adds.sh N ARG1 .. ARGN COMMAND...: runs COMMAND on every rank of an
# mpirun job, with ARG1 .. ARGN appended on rank 1 only: ranks whose flags disagree.
# The rank comes from Open MPI's or MPICH's environment.
n=$1
shift
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
i=0
while [ "$i" -lt "$n" ]; do
  if [ "$rank" = 1 ]; then set -- "$@" "$1"; fi
  shift
  i=$((i + 1))
done
exec "$@"
