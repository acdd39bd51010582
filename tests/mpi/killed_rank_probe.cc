// tests/mpi/killed_rank_probe.cc: a job in which one rank dies (SIGKILL, as the OOM killer
// or a node failure would) just before the forward that the others enter. Run under
// mpirun by expect_job_ends.cmake, which requires the launcher to end the whole job with
// an error within a bounded time instead of leaving the survivors waiting.
#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "vpce/mpi.h"
#include "vpce/vpce.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int victim = argc > 1 ? std::atoi(argv[1]) : 1;
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  std::unique_ptr<vpce::MpiCommunicator> comm;
  if (!vpce::MpiCommunicator::create(MPI_COMM_WORLD, &comm).ok()) return 3;

  const int64_t tokens = 8;
  const int64_t cols = 16;
  std::vector<float> logits(tokens * cols, 0.5f), loss(tokens), lse(tokens);
  std::vector<int64_t> targets(tokens, 3);
  const vpce::VocabShard shard{rank * cols, (rank + 1) * cols, ranks * cols};
  if (rank == victim) {
    std::printf("rank %d: killing itself\n", rank);
    std::fflush(stdout);
    std::raise(SIGKILL);
  }
  const vpce::Status s =
      vpce::forward(*comm, vpce::TensorView::contiguous(logits.data(), vpce::kFloat32, {tokens, cols}),
                    vpce::TensorView::contiguous(targets.data(), vpce::kInt64, {tokens}), shard, {},
                    vpce::TensorView::contiguous(loss.data(), vpce::kFloat32, {tokens}),
                    vpce::TensorView::contiguous(lse.data(), vpce::kFloat32, {tokens}));
  // Not reached while the launcher does its job: the survivors are killed in the forward.
  std::printf("rank %d: forward returned: %s\n", rank, s.to_string().c_str());
  comm.reset();
  MPI_Finalize();
  return 0;
}
