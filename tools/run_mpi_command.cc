// tools/run_mpi_command.cc: `vpce run --backend mpi`, one process per rank under mpirun.
//
// Every rank reads the targets (and weights, upstream gradient) and only its own columns
// of the logits, runs the forward (one MPI all-gather) and the backward on them, and sends
// its gradient columns to rank 0, which writes every output. Any rank's failure (a file it
// cannot read, a bad option, memory it cannot allocate) becomes the same error on every
// rank: the ranks first agree on every flag, then on a status before each step that could
// otherwise leave one waiting for another; each of these waits is bounded by --timeout.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "checks.h"
#include "cpu/dtype.h"
#include "mpi_collectives.h"
#include "run_io.h"
#include "vpce/mpi.h"

namespace vpce::tools {
namespace {

// MPI_Init_thread on construction unless MPI is already up; MPI_Finalize on destruction if
// this object started it.
class MpiSession {
 public:
  MpiSession() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      started_ = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) == MPI_SUCCESS;
    }
  }
  ~MpiSession() {
    if (started_) MPI_Finalize();
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  bool started_ = false;
};

// Rank 0 receives every rank's [tokens, cols] float32 gradient block into the columns of
// the [tokens, vocab] matrix `full`; the others send theirs. Rows travel in chunks that
// keep each message's count within an int; every wait is bounded.
Status gather_gradient(const ToolCollectives& world, const std::vector<float>& mine,
                       const std::vector<VocabShard>& shards, int64_t tokens, int64_t vocab, std::vector<float>* full) {
  constexpr int kTag = 7;
  const auto chunk_rows = [](int64_t cols) {
    return std::max<int64_t>(1, (int64_t{1} << 28) / std::max<int64_t>(cols, 1));
  };
  const int rank = world.rank();
  if (rank != 0) {
    const int64_t cols =
        shards[static_cast<std::size_t>(rank)].vocab_end - shards[static_cast<std::size_t>(rank)].vocab_begin;
    for (int64_t row = 0; row < tokens && cols > 0; row += chunk_rows(cols)) {
      const int64_t rows = std::min(chunk_rows(cols), tokens - row);
      MPI_Request request = MPI_REQUEST_NULL;
      MPI_Isend(mine.data() + row * cols, static_cast<int>(rows * cols), MPI_FLOAT, 0, kTag, MPI_COMM_WORLD, &request);
      if (Status s = world.wait(&request, "sending the gradient to rank 0"); !s.ok()) return s;
    }
    return {};
  }
  std::vector<float> block;
  for (std::size_t r = 0; r < shards.size(); ++r) {
    const int64_t begin = shards[r].vocab_begin;
    const int64_t cols = shards[r].vocab_end - begin;
    for (int64_t row = 0; row < tokens && cols > 0; row += chunk_rows(cols)) {
      const int64_t rows = std::min(chunk_rows(cols), tokens - row);
      const float* source = mine.data() + row * cols;
      if (r != 0) {
        block.resize(static_cast<std::size_t>(rows * cols));
        MPI_Request request = MPI_REQUEST_NULL;
        MPI_Irecv(block.data(), static_cast<int>(rows * cols), MPI_FLOAT, static_cast<int>(r), kTag, MPI_COMM_WORLD,
                  &request);
        if (Status s = world.wait(&request, "receiving the gradient"); !s.ok()) return s;
        source = block.data();
      }
      for (int64_t i = 0; i < rows; ++i) {
        std::memcpy(full->data() + (row + i) * vocab + begin, source + i * cols,
                    static_cast<std::size_t>(cols) * sizeof(float));
      }
    }
  }
  return {};
}

// This rank's part of the run: read, forward, backward. Fills `out` and `grad` ([tokens,
// cols] float32).
struct RankRun {
  npy::Info info;
  std::vector<VocabShard> shards;
  RankOutputs out;
  std::vector<float> grad;
  DataType dtype = kFloat32;
  double elapsed_ms = 0.0;
};

// Reads this rank's inputs; run->info is the logits' header, read and checked already.
Status prepare(const RunConfig& config, int rank, int ranks, RankRun* run, TokenInputs* in, ComputeBuffer* logits) {
  const std::vector<int64_t> leading(run->info.shape.begin(), run->info.shape.end() - 1);
  if (Status s = read_token_inputs(config, leading, in); !s.ok()) return s;
  const int64_t vocab = run->info.shape.back();
  if (config.ranks_given && config.ranks != ranks) {
    return {Code::kInvalidArgument, "--tp: expected the number of MPI ranks, " + std::to_string(ranks) + ", got " +
                                        std::to_string(config.ranks)};
  }
  if (!config.vocab_splits.empty() && config.vocab_splits.size() != static_cast<std::size_t>(ranks)) {
    return {Code::kInvalidArgument, "--vocab-splits: expected one size per MPI rank (" + std::to_string(ranks) +
                                        "), got " + std::to_string(config.vocab_splits.size())};
  }
  if (Status s = vocab_ranges(config, ranks, vocab, &run->shards); !s.ok()) return s;
  const VocabShard& shard = run->shards[static_cast<std::size_t>(rank)];
  npy::Array columns;
  if (Status s = npy::read_columns(config.logits_path, shard.vocab_begin, shard.vocab_end, &columns); !s.ok()) return s;
  return make_compute_buffer(columns, config.dtype, logits);
}

Status compute(const RunConfig& config, MpiCommunicator& comm, int ranks_on_host, const TokenInputs& in,
               ComputeBuffer& logits, RankRun* run) {
  const VocabShard& shard = run->shards[static_cast<std::size_t>(comm.rank())];
  const int64_t tokens = static_cast<int64_t>(in.targets.numel());
  const int64_t cols = shard.vocab_end - shard.vocab_begin;
  const bool reduced = config.loss.reduction != Reduction::kNone;
  run->dtype = logits.dtype;
  run->out = make_rank_outputs(config, tokens);
  run->grad.assign(static_cast<std::size_t>(tokens * cols), 0.0f);
  std::vector<float> ones(static_cast<std::size_t>(std::max<int64_t>(tokens, 1)), 1.0f);
  const float* upstream = config.grad_output_path.empty() ? ones.data() : in.grad_output.as<float>();
  const TensorView weights = TensorView::contiguous(in.weights.data.data(), kFloat32, {tokens});
  LossOptions options = config.loss;
  if (options.num_threads == 0) {  // the cores of this host, shared among its ranks
    options.num_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks_on_host);
  }

  RankOutputs& out = run->out;
  const TensorView x = TensorView::contiguous(logits.data(), logits.dtype, {tokens, cols});
  const TensorView y = TensorView::contiguous(in.targets.data.data(),
                                              in.targets.dtype == npy::Dtype::kInt64 ? kInt64 : kInt32, {tokens});
  const ForwardOutputs views(config, out, tokens, &weights);
  const auto start = std::chrono::steady_clock::now();
  if (Status s = forward(comm, x, y, shard, options, views.loss, views.lse, views.extras); !s.ok()) return s;
  const TensorView g = TensorView::contiguous(upstream, kFloat32, {reduced ? 1 : tokens});
  const TensorView grad = config.in_place ? x : TensorView::contiguous(run->grad.data(), kFloat32, {tokens, cols});
  if (Status s = backward(x, y, views.lse, g, shard, options, grad, views.extras.weights); !s.ok()) return s;
  run->elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (config.in_place) {
    for (std::size_t i = 0; i < run->grad.size(); ++i) {
      run->grad[i] = detail::widen(logits.data() + i * static_cast<std::size_t>(logits.dtype.bytes()), logits.dtype);
    }
  }
  return {};
}

// The run on every rank; returns the same status everywhere, except kTimeout, which only
// the ranks that waited in vain return.
Status run_ranks(const RunConfig& config, const ToolCollectives& world) {
  const int rank = world.rank();
  const int ranks = world.size();
  int ranks_on_host = 1;
  if (Status s = world.agree_flags(config, &ranks_on_host); !s.ok()) return s;
  RankRun run;
  TokenInputs in;
  ComputeBuffer logits;
  const auto prepared = [&] {
    if (Status s = check_threads("--threads", config.loss.num_threads); !s.ok()) return s;
    if (Status s = read_logits_info(config, &run.info); !s.ok()) return s;
    return catch_out_of_memory("run: " + memory_needed(config, run.info),
                               [&] { return prepare(config, rank, ranks, &run, &in, &logits); });
  };
  if (Status s = world.agree(prepared()); !s.ok()) return s;
  std::unique_ptr<MpiCommunicator> comm;
  MpiOptions options;
  options.timeout = std::chrono::seconds(config.timeout_s);
  if (Status s = world.agree(MpiCommunicator::create(MPI_COMM_WORLD, &comm, options)); !s.ok()) return s;
  // The forward's errors are the same on every rank already; the backward's are local.
  const Status computed = catch_out_of_memory("run: " + memory_needed(config, run.info),
                                              [&] { return compute(config, *comm, ranks_on_host, in, logits, &run); });
  if (Status s = world.agree(computed); !s.ok()) return s;
  comm.reset();

  const int64_t vocab = run.info.shape.back();
  const int64_t tokens = static_cast<int64_t>(run.out.lse.size());
  std::vector<float> full;
  const Status allocated = catch_out_of_memory("run: rank 0's whole gradient", [&] {
    full.resize(rank == 0 ? static_cast<std::size_t>(tokens * vocab) : 0);
    return Status();
  });
  if (Status s = world.agree(allocated); !s.ok()) return s;
  if (Status s = world.agree(gather_gradient(world, run.grad, run.shards, tokens, vocab, &full)); !s.ok()) return s;
  double slowest_ms = 0.0;
  if (Status s = world.max(run.elapsed_ms, &slowest_ms); !s.ok()) return s;
  Status written;
  if (rank == 0) {
    char tail[96];
    std::snprintf(tail, sizeof(tail), "time %.3f ms (forward + backward, slowest rank)", slowest_ms);
    written = write_outputs(config, run.info.shape, run.out, full.data(),
                            "R " + std::to_string(ranks) + "  dtype " + to_string(run.dtype) + "  backend mpi", tail);
  }
  return world.agree(written);
}

}  // namespace

Status run_mpi_command(const RunConfig& config, bool* reports) {
  *reports = true;
  MpiSession session;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return {Code::kSystemError, "--backend mpi: MPI_Init_thread failed"};
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const ToolCollectives world(rank, ranks, std::chrono::seconds(config.timeout_s));
  Status status = run_ranks(config, world);
  // Every rank has the same status; rank 0 prints it before any rank exits, since the
  // launcher ends the whole job as soon as one process exits with an error.
  if (!status.ok() && rank == 0 && status.code() != Code::kTimeout) {
    std::fprintf(stderr, "vpce: error: %s\n", status.to_string().c_str());
    std::fflush(stderr);
  }
  if (status.code() != Code::kTimeout) {
    if (Status s = world.barrier(); !s.ok()) status = s;
  }
  if (status.code() == Code::kTimeout) {
    // A rank that never arrived cannot be waited for, nor MPI finalised with it: this rank
    // reports and ends the job (the launcher stops the others, the absent one included).
    // The pause lets the launcher forward the line first: MPICH's drops what it has not
    // read when an abort reaches it (the stopped-rank test lost it once in 30 runs).
    std::fprintf(stderr, "vpce: error: rank %d: %s\n", rank, status.to_string().c_str());
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::seconds(1));
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  *reports = false;
  return status;
}

}  // namespace vpce::tools
