// tests/mpi/collective_counter.h: counts the MPI calls this process makes, through the MPI
// profiling interface (collective_counter.cc defines MPI_Allgather & co. and forwards them
// to PMPI_*), so that a test can see how many collectives a vpce call issued.
#pragma once

namespace vpce::test {

struct MpiCallCounts {
  int collectives = 0;     // all-gathers, all-reduces, broadcasts, barriers, ... (blocking or not)
  int point_to_point = 0;  // sends and receives
};

// The counts since the last reset.
MpiCallCounts mpi_call_counts();
void reset_mpi_call_counts();

}  // namespace vpce::test
