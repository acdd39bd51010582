// examples/bigram_mpi/train.cc: trains a byte-level bigram language model whose output layer
// is split over the vocabulary across R MPI ranks, with vpce computing the loss.
//
//   mpirun -np 4 ./vpce_bigram_train --text input.txt [--steps 40] [--tokens 512] [--dim 32]
//
// The model: an embedding E [V, d] (replicated on every rank) of the previous byte, then an
// output layer W [d, V] + b [V] whose columns are split over the ranks, as in a Megatron
// tensor-parallel LM head. Each step, on every rank:
//   H = E[prev]                 [N, d]       (replicated)
//   logits_r = H W_r + b_r      [N, V/R]     (this rank's columns only)
//   vpce::forward  -> mean loss, lse        (one all-gather of 16 bytes per token)
//   vpce::backward -> dlogits_r in place    (no communication)
//   dW_r = H^T dlogits_r, db_r = sum dlogits_r          (local)
//   dH = sum over ranks of dlogits_r W_r^T               (one MPI_Allreduce, as in Megatron)
//   SGD on E, W_r, b_r.
// Parameters start from a counter-based hash of their global index, so R ranks start from
// exactly the model that one rank would, and the loss curves agree for any R.
#include <mpi.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "vpce/mpi.h"
#include "vpce/vpce.h"

namespace {

constexpr int64_t kVocab = 256;  // bytes

struct Args {
  std::string text;
  int steps = 40;
  int64_t tokens = 512;
  int64_t dim = 32;
  float learning_rate = 2.0f;
};

bool parse_args(int argc, char** argv, Args* args) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--text") {
      args->text = value;
    } else if (flag == "--steps") {
      args->steps = std::atoi(value);
    } else if (flag == "--tokens") {
      args->tokens = std::atoll(value);
    } else if (flag == "--dim") {
      args->dim = std::atoll(value);
    } else if (flag == "--lr") {
      args->learning_rate = std::strtof(value, nullptr);
    } else {
      return false;
    }
  }
  return !args->text.empty() && argc % 2 == 1 && args->steps > 0 && args->tokens > 0 && args->dim > 0;
}

// A uniform value in [-scale, scale) from (tensor, row, col): the same on every rank.
float initial_value(uint64_t tensor, int64_t row, int64_t col, float scale) {
  uint64_t z = tensor * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(row) * 0xBF58476D1CE4E5B9ull +
               static_cast<uint64_t>(col) * 0x94D049BB133111EBull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;  // splitmix64's finaliser
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return scale * (2.0f * static_cast<float>(z >> 40) / static_cast<float>(1 << 24) - 1.0f);
}

// Rank 0 reads the file and broadcasts it, so that only one host needs it.
bool load_text(const std::string& path, int rank, std::vector<unsigned char>* text) {
  long long size = 0;
  if (rank == 0) {
    std::ifstream file(path, std::ios::binary);
    if (file) text->assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    size = file && text->size() <= INT_MAX ? static_cast<long long>(text->size()) : -1;
  }
  MPI_Bcast(&size, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  if (size < 0) return false;
  text->resize(static_cast<std::size_t>(size));
  MPI_Bcast(text->data(), static_cast<int>(size), MPI_UNSIGNED_CHAR, 0, MPI_COMM_WORLD);
  return true;
}

// Before training: every rank fails alike (same arguments, same broadcast text).
int fail(int rank, const std::string& message) {
  if (rank == 0) std::fprintf(stderr, "vpce_bigram_train: %s\n", message.c_str());
  MPI_Finalize();
  return 2;
}

// During training a failure may be one rank's alone (the backward is local): end the job
// rather than leave the others waiting in the next collective.
[[noreturn]] void abort_job(int rank, const vpce::Status& status) {
  std::fprintf(stderr, "vpce_bigram_train: rank %d: %s\n", rank, status.to_string().c_str());
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::abort();  // not reached: MPI_Abort does not return
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  Args args;
  if (!parse_args(argc, argv, &args)) {
    return fail(rank, "usage: vpce_bigram_train --text FILE [--steps S] [--tokens N] [--dim D] [--lr LR]");
  }
  std::vector<unsigned char> text;
  if (!load_text(args.text, rank, &text)) return fail(rank, args.text + ": cannot read (or larger than 2 GiB)");
  const int64_t n = args.tokens;
  const int64_t d = args.dim;
  if (static_cast<int64_t>(text.size()) < n + 2) {
    return fail(rank, args.text + ": expected more than " + std::to_string(n + 1) + " bytes");
  }

  // This rank's columns of the output layer: an even split of the 256 byte values.
  const int64_t begin = kVocab * rank / ranks;
  const int64_t end = kVocab * (rank + 1) / ranks;
  const int64_t cols = end - begin;
  const vpce::VocabShard shard{begin, end, kVocab};

  std::vector<float> embedding(kVocab * d), weight(d * cols), bias(cols, 0.0f);
  for (int64_t v = 0; v < kVocab; ++v) {
    for (int64_t k = 0; k < d; ++k) embedding[v * d + k] = initial_value(1, v, k, 0.5f);
  }
  for (int64_t k = 0; k < d; ++k) {
    for (int64_t c = 0; c < cols; ++c) weight[k * cols + c] = initial_value(2, k, begin + c, 0.5f);
  }

  std::unique_ptr<vpce::MpiCommunicator> comm;
  if (vpce::Status s = vpce::MpiCommunicator::create(MPI_COMM_WORLD, &comm); !s.ok()) return fail(rank, s.to_string());
  vpce::LossOptions options;
  options.reduction = vpce::Reduction::kMean;
  vpce::Workspace workspace;  // reused across steps: no allocation in the loop's forward

  std::vector<int64_t> previous(n), targets(n);
  std::vector<float> hidden(n * d), logits(n * cols);
  std::vector<double> lse(n);  // float64: the gradient exact whatever the logits' size
  std::vector<double> grad_hidden(n * d), grad_hidden_sum(n * d);
  std::vector<float> grad_weight(d * cols), grad_bias(cols);
  const float one = 1.0f;
  const int64_t windows = static_cast<int64_t>(text.size()) - n - 1;
  for (int step = 0; step < args.steps; ++step) {
    const int64_t start = (static_cast<int64_t>(step) * 7919 * n) % windows;  // a different window each step
    for (int64_t i = 0; i < n; ++i) {
      previous[i] = text[static_cast<std::size_t>(start + i)];
      targets[i] = text[static_cast<std::size_t>(start + i + 1)];
      std::memcpy(&hidden[i * d], &embedding[previous[i] * d], static_cast<std::size_t>(d) * sizeof(float));
    }
    // logits_r = H W_r + b_r   [n, cols]
    for (int64_t i = 0; i < n; ++i) {
      float* row = &logits[i * cols];
      for (int64_t c = 0; c < cols; ++c) row[c] = bias[c];
      for (int64_t k = 0; k < d; ++k) {
        const float h = hidden[i * d + k];
        const float* w = &weight[k * cols];
        for (int64_t c = 0; c < cols; ++c) row[c] += h * w[c];
      }
    }

    float loss = 0.0f;
    const auto x = vpce::TensorView::contiguous(logits.data(), vpce::kFloat32, {n, cols});
    const auto y = vpce::TensorView::contiguous(targets.data(), vpce::kInt64, {n});
    const auto lse_view = vpce::TensorView::contiguous(lse.data(), vpce::kFloat64, {n});
    if (vpce::Status s =
            vpce::forward(*comm, x, y, shard, options, vpce::TensorView::contiguous(&loss, vpce::kFloat32, {1}),
                          lse_view, {}, &workspace);
        !s.ok()) {
      abort_job(rank, s);
    }
    const auto upstream = vpce::TensorView::contiguous(&one, vpce::kFloat32, {1});
    if (vpce::Status s = vpce::backward(x, y, lse_view, upstream, shard, options, x); !s.ok()) {
      abort_job(rank, s);
    }  // the gradient is now in `logits`
    if (rank == 0) std::printf("step %3d  loss %.6f\n", step, loss);

    // dW_r = H^T G, db_r = column sums of G, dH_r = G W_r^T (summed over ranks in double).
    std::fill(grad_weight.begin(), grad_weight.end(), 0.0f);
    std::fill(grad_bias.begin(), grad_bias.end(), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float* g = &logits[i * cols];
      for (int64_t c = 0; c < cols; ++c) grad_bias[c] += g[c];
      for (int64_t k = 0; k < d; ++k) {
        const float h = hidden[i * d + k];
        const float* w = &weight[k * cols];
        float* gw = &grad_weight[k * cols];
        double dot = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
          gw[c] += h * g[c];
          dot += static_cast<double>(g[c]) * w[c];
        }
        grad_hidden[i * d + k] = dot;
      }
    }
    MPI_Allreduce(grad_hidden.data(), grad_hidden_sum.data(), static_cast<int>(n * d), MPI_DOUBLE, MPI_SUM,
                  MPI_COMM_WORLD);
    const float lr = args.learning_rate;
    for (std::size_t j = 0; j < weight.size(); ++j) weight[j] -= lr * grad_weight[j];
    for (int64_t c = 0; c < cols; ++c) bias[c] -= lr * grad_bias[c];
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < d; ++k) {
        embedding[previous[i] * d + k] -= lr * static_cast<float>(grad_hidden_sum[i * d + k]);
      }
    }
  }
  comm.reset();
  MPI_Finalize();
  return 0;
}
