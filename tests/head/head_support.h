// tests/head/head_support.h: the fused head's test problems and their fp64 oracle.
//
// A problem is hidden [N, H] (strided rows, misaligned start), the full output weight
// [V, H] (strided rows) whose row ranges the ranks take, a bias [V], targets, weights and
// per-token upstream gradients, stored in one dtype. The oracle takes the product
// h W^T + b in fp64 from the stored values, then the loss oracle, then dh = dx W,
// dW = dx^T h, db = column sums of dx, in fp64 (src/reference/head_reference.h).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "reference/head_reference.h"
#include "support.h"
#include "vpce/head.h"
#include "vpce/vpce.h"

namespace vpce::test {

struct HeadProblem {
  int64_t tokens = 0, hidden = 0, vocab = 0;
  DataType dtype = kFloat32;
  int64_t ld_hidden = 0, ld_weight = 0;
  std::vector<std::byte> hidden_storage, weight_storage, bias_storage;
  std::vector<int64_t> targets;
  std::vector<float> weights;    // empty: none
  std::vector<float> grad_loss;  // [N]
  bool with_bias = true;

  // One element past a 64-byte boundary (as allocated): no row is cache-line aligned.
  std::byte* hidden_base() { return hidden_storage.data() + dtype.bytes(); }
  std::byte* weight_base() { return weight_storage.data(); }
  double hidden_at(int64_t i, int64_t k) const;
  double weight_at(int64_t v, int64_t k) const;
  double bias_at(int64_t v) const;
  void set_hidden(int64_t i, int64_t k, float value);
  void set_bias(int64_t v, float value);
  TensorView hidden_view();
  // Rows [begin, end) of the weight, and of the bias.
  TensorView weight_view(int64_t begin, int64_t end);
  TensorView bias_view(int64_t begin, int64_t end);
};

// Normal(0, 1 / sqrt(H)) weights and Normal(0, std) hidden states, so the logits have a
// standard deviation of about `std`; targets uniform with every 7th token ignore_index.
HeadProblem random_head_problem(int64_t tokens, int64_t hidden, int64_t vocab, DataType dtype, uint64_t seed,
                                float std = 3.0f, bool with_bias = true);

using HeadOracle = reference::HeadResult;  // (src/reference/head_reference.h)

// grad_scalar: the upstream gradient of a reduced loss (per-token grad_loss otherwise).
// bf16_logit_gradients: the logit gradients rounded to bf16 (through fp32, to nearest even)
// before the gradients' sums, as HeadOptions::bf16_logit_gradients asks.
// legacy_shard: with SmoothingSemantics::kMegatronLegacy, the rank's shard whose loss the
// oracle computes (that rank's smoothing over its own columns). round_logits: the logits
// rounded to the problem's dtype as HeadOptions::round_logits asks.
HeadOracle head_oracle(const HeadProblem& p, const LossOptions& options, float grad_scalar,
                       bool bf16_logit_gradients = false, const VocabShard* legacy_shard = nullptr,
                       bool round_logits = false);

enum class Mode { kRecompute, kChunked };

// One run of the head on R in-process ranks: its mode, options and how it writes the gradients.
struct HeadRun {
  Mode mode = Mode::kRecompute;
  LossOptions loss;
  HeadOptions head;
  int ranks = 1;
  std::vector<int64_t> sizes;  // vocabulary rows per rank; empty: even
  bool accumulate = false;     // add into fp32 gradients prefilled with `prefill`
  float prefill = 0.0f;
  float grad_scalar = 1.0f;
  bool reduce_hidden = false;  // all_reduce_hidden_gradient instead of summing in the test
  bool want_bias = true;
  DataType grad_dtype = kFloat32;                // written-over gradients
  std::vector<Workspace>* workspaces = nullptr;  // one per rank, kept across runs; null: none
  DataType lse_dtype = kFloat64;                 // the lse kept for the backward (or kFloat32)
  // ranks == 1 only: the call runs on the calling thread through a Loopback communicator
  // (as a program calling vpce from its own threads, e.g. inside an OpenMP team, does),
  // rather than on a ThreadGroup's thread.
  bool on_calling_thread = false;
};

// What run_head gives back: every rank's status, rank 0's outputs, the gathered gradients.
struct HeadResult {
  std::vector<Status> status;
  std::vector<float> loss;  // rank 0's
  std::vector<double> lse;  // rank 0's, widened
  std::vector<std::vector<float>> loss_of_rank;
  std::vector<double> grad_hidden;  // the sum of the ranks' parts (or the reduced one)
  std::vector<double> grad_weight, grad_bias;
  std::vector<std::vector<float>> hidden_parts;  // per rank, as written (fp32 widened)
  int64_t collectives = -1;
};

// Runs the forward and backward (or the chunked call) on run.ranks in-process ranks.
HeadResult run_head(HeadProblem& p, const HeadRun& run);
void expect_ok(const HeadResult& r);
// Loss within 1e-6 and the gradients within 1e-5 of the oracle (relative to their largest),
// the same loss bits on every rank.
void expect_matches(const HeadProblem& p, const HeadRun& run, const HeadResult& r, double loss_tol = 1e-6,
                    double grad_tol = 1e-5);

}  // namespace vpce::test
