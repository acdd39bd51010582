// tests/mpi/stop_after_init.cc: preloaded into one rank (LD_PRELOAD), it stops that
// process with SIGSTOP right after MPI is initialised: a rank that is alive but never
// arrives at the first collective, as a stopped or swapped-out process is.
#include <mpi.h>

#include <csignal>

extern "C" int MPI_Init_thread(int* argc, char*** argv, int required, int* provided) {
  const int rc = PMPI_Init_thread(argc, argv, required, provided);
  std::raise(SIGSTOP);
  return rc;
}

extern "C" int MPI_Init(int* argc, char*** argv) {
  const int rc = PMPI_Init(argc, argv);
  std::raise(SIGSTOP);
  return rc;
}
