// bench/mpi_collectives_bench.cc: which MPI collective should carry the forward's per-token
// statistics? Run under mpirun -np R. For each token count N it times, in one run:
//   vpce       MpiCommunicator::all_gather of the forward's payload (256 + 16 N bytes per
//              rank): what vpce::forward does, blocks and size agreement included
//   allgather  a bare MPI_Allgather of the same bytes
//   iallgather MPI_Iallgather + MPI_Test polling (what the backend does to honour a timeout)
//   allreduce  MPI_Allreduce of [N] x 16-byte TokenStats with a user-defined merge op
// Each cell is the median over iterations of the slowest rank's time, in microseconds.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

#include "vpce/mpi.h"

namespace {

struct Stats {
  float max, sum_exp, target_logit, sum_logits;
};

// The forward's merge of two ranks' statistics, as an MPI reduction (commutative).
void merge(void* in, void* inout, int* count, MPI_Datatype*) {
  const auto* a = static_cast<const Stats*>(in);
  auto* b = static_cast<Stats*>(inout);
  for (int i = 0; i < *count; ++i) {
    const float m = std::max(a[i].max, b[i].max);
    const float sa = m == -INFINITY ? 0.0f : a[i].sum_exp * std::exp(a[i].max - m);
    const float sb = m == -INFINITY ? 0.0f : b[i].sum_exp * std::exp(b[i].max - m);
    b[i] = {m, sa + sb, std::max(a[i].target_logit, b[i].target_logit), a[i].sum_logits + b[i].sum_logits};
  }
}

// Median over `iterations` of the slowest rank's time for fn(), in microseconds.
double time_us(int iterations, const std::function<void()>& fn) {
  std::vector<double> samples;
  for (int it = 0; it < iterations + 3; ++it) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = std::chrono::steady_clock::now();
    fn();
    double mine = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    double slowest = 0.0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (it >= 3) samples.push_back(slowest);  // three warm-up rounds
  }
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 50;

  std::unique_ptr<vpce::MpiCommunicator> comm;
  if (!vpce::MpiCommunicator::create(MPI_COMM_WORLD, &comm).ok()) MPI_Abort(MPI_COMM_WORLD, 1);
  MPI_Datatype stats_type;
  MPI_Type_contiguous(4, MPI_FLOAT, &stats_type);
  MPI_Type_commit(&stats_type);
  MPI_Op merge_op;
  MPI_Op_create(&merge, /*commute=*/1, &merge_op);

  if (rank == 0) {
    std::printf("# R = %d ranks, median of %d iterations, slowest rank, microseconds\n", ranks, iterations);
    std::printf("%8s %10s %10s %10s %11s %10s %16s\n", "tokens", "bytes/rank", "vpce", "allgather", "iallgather",
                "allreduce", "allreduce/vpce");
  }
  for (int64_t n = 256; n <= 65536; n *= 4) {
    const std::size_t bytes = 256 + static_cast<std::size_t>(n) * sizeof(Stats);
    std::vector<unsigned char> send(bytes, static_cast<unsigned char>(rank)), recv(bytes * ranks);
    std::vector<Stats> stats(static_cast<std::size_t>(n), Stats{1.0f + rank, 2.0f, -INFINITY, 0.5f});
    std::vector<Stats> reduced(static_cast<std::size_t>(n));
    const int count = static_cast<int>(bytes);
    const double vpce_us = time_us(iterations, [&] {
      if (!comm->all_gather(send.data(), recv.data(), bytes).ok()) MPI_Abort(MPI_COMM_WORLD, 2);
    });
    const double allgather_us = time_us(
        iterations, [&] { MPI_Allgather(send.data(), count, MPI_BYTE, recv.data(), count, MPI_BYTE, MPI_COMM_WORLD); });
    const double iallgather_us = time_us(iterations, [&] {
      MPI_Request request;
      MPI_Iallgather(send.data(), count, MPI_BYTE, recv.data(), count, MPI_BYTE, MPI_COMM_WORLD, &request);
      for (int done = 0; !done;) MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    });
    const double allreduce_us = time_us(iterations, [&] {
      MPI_Allreduce(stats.data(), reduced.data(), static_cast<int>(n), stats_type, merge_op, MPI_COMM_WORLD);
    });
    if (rank == 0) {
      std::printf("%8lld %10zu %10.1f %10.1f %11.1f %10.1f %16.2f\n", static_cast<long long>(n), bytes, vpce_us,
                  allgather_us, iallgather_us, allreduce_us, allreduce_us / vpce_us);
    }
  }
  MPI_Op_free(&merge_op);
  MPI_Type_free(&stats_type);
  comm.reset();
  MPI_Finalize();
  return 0;
}
