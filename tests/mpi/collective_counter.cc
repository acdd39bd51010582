// tests/mpi/collective_counter.cc: MPI profiling-interface wrappers that count calls.
//
// The MPI standard gives every MPI_X a PMPI_X twin; a definition of MPI_X in the program
// takes precedence over the library's, so these see every call made by vpce::mpi too.
#include "collective_counter.h"

#include <mpi.h>

namespace vpce::test {
namespace {
MpiCallCounts counts;
}  // namespace

MpiCallCounts mpi_call_counts() { return counts; }
void reset_mpi_call_counts() { counts = {}; }

}  // namespace vpce::test

using vpce::test::counts;

extern "C" {

int MPI_Allgather(const void* s, int sc, MPI_Datatype st, void* r, int rc, MPI_Datatype rt, MPI_Comm c) {
  ++counts.collectives;
  return PMPI_Allgather(s, sc, st, r, rc, rt, c);
}
int MPI_Iallgather(const void* s, int sc, MPI_Datatype st, void* r, int rc, MPI_Datatype rt, MPI_Comm c,
                   MPI_Request* q) {
  ++counts.collectives;
  return PMPI_Iallgather(s, sc, st, r, rc, rt, c, q);
}
int MPI_Allgatherv(const void* s, int sc, MPI_Datatype st, void* r, const int rc[], const int d[], MPI_Datatype rt,
                   MPI_Comm c) {
  ++counts.collectives;
  return PMPI_Allgatherv(s, sc, st, r, rc, d, rt, c);
}
int MPI_Allreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c) {
  ++counts.collectives;
  return PMPI_Allreduce(s, r, n, t, o, c);
}
int MPI_Iallreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c, MPI_Request* q) {
  ++counts.collectives;
  return PMPI_Iallreduce(s, r, n, t, o, c, q);
}
int MPI_Reduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, int root, MPI_Comm c) {
  ++counts.collectives;
  return PMPI_Reduce(s, r, n, t, o, root, c);
}
int MPI_Bcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c) {
  ++counts.collectives;
  return PMPI_Bcast(b, n, t, root, c);
}
int MPI_Ibcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c, MPI_Request* q) {
  ++counts.collectives;
  return PMPI_Ibcast(b, n, t, root, c, q);
}
int MPI_Barrier(MPI_Comm c) {
  ++counts.collectives;
  return PMPI_Barrier(c);
}
int MPI_Ibarrier(MPI_Comm c, MPI_Request* q) {
  ++counts.collectives;
  return PMPI_Ibarrier(c, q);
}
int MPI_Gather(const void* s, int sc, MPI_Datatype st, void* r, int rc, MPI_Datatype rt, int root, MPI_Comm c) {
  ++counts.collectives;
  return PMPI_Gather(s, sc, st, r, rc, rt, root, c);
}
int MPI_Alltoall(const void* s, int sc, MPI_Datatype st, void* r, int rc, MPI_Datatype rt, MPI_Comm c) {
  ++counts.collectives;
  return PMPI_Alltoall(s, sc, st, r, rc, rt, c);
}
int MPI_Send(const void* b, int n, MPI_Datatype t, int dest, int tag, MPI_Comm c) {
  ++counts.point_to_point;
  return PMPI_Send(b, n, t, dest, tag, c);
}
int MPI_Isend(const void* b, int n, MPI_Datatype t, int dest, int tag, MPI_Comm c, MPI_Request* q) {
  ++counts.point_to_point;
  return PMPI_Isend(b, n, t, dest, tag, c, q);
}
int MPI_Recv(void* b, int n, MPI_Datatype t, int source, int tag, MPI_Comm c, MPI_Status* st) {
  ++counts.point_to_point;
  return PMPI_Recv(b, n, t, source, tag, c, st);
}
int MPI_Irecv(void* b, int n, MPI_Datatype t, int source, int tag, MPI_Comm c, MPI_Request* q) {
  ++counts.point_to_point;
  return PMPI_Irecv(b, n, t, source, tag, c, q);
}

}  // extern "C"
