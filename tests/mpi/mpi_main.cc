// tests/mpi/mpi_main.cc: GoogleTest's main under MPI: every rank runs the same tests in the
// same order. Rank 0 prints the usual report; the other ranks print only their failures,
// prefixed with their rank. A rank fails if it saw a failure, so mpirun fails if any did.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

namespace {

class FailuresOnly : public testing::EmptyTestEventListener {
 public:
  explicit FailuresOnly(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::printf("[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                result.line_number(), result.message());
    std::fflush(stdout);
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailuresOnly(rank));
  }
  const int failed = RUN_ALL_TESTS();
  MPI_Finalize();
  return failed;
}
