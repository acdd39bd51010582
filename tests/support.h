// tests/support.h: what the tests share: random inputs in every dtype, laid out as R
// shards of one strided, deliberately misaligned [N, ld] buffer; a runner that calls
// vpce on R in-process ranks; and error measures against the fp64 oracle.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "reference/reference.h"
#include "vpce/vpce.h"

namespace vpce::test {

// Shard sizes: as even as possible (the first V % R shards one larger).
std::vector<int64_t> even_splits(int64_t vocab, int ranks);
std::vector<VocabShard> shards_from_sizes(const std::vector<int64_t>& sizes);

// A full [N, V] logits problem stored in `dtype` inside a buffer with row stride ld > V
// and a start offset of one element, so that no row is 64-byte aligned.
struct Problem {
  int64_t tokens = 0;
  int64_t vocab = 0;
  int64_t ld = 0;
  DataType dtype = kFloat32;
  std::vector<std::byte> storage;
  std::size_t offset_bytes = 0;
  std::vector<int64_t> targets;
  std::vector<float> grad_loss;  // per-token upstream gradient

  std::byte* base() { return storage.data() + offset_bytes; }
  // The value at (i, v) as stored, widened to double: what the oracle sees.
  double at(int64_t i, int64_t v) const;
  void set(int64_t i, int64_t v, float value);
  std::vector<double> as_double() const;  // [N, V] row-major
  // Rank view of columns [shard.vocab_begin, shard.vocab_end).
  TensorView shard_view(const VocabShard& shard);
};

// Normal(0, stddev) logits rounded to `dtype`, uniform targets, upstream gradients in [0.5, 2).
Problem random_problem(int64_t tokens, int64_t vocab, DataType dtype, uint64_t seed, float stddev = 3.0f);

// Two tokens (targets 0 and 1) of `vocab` columns whose token 0 holds NaN in columns
// [nan_begin, nan_end) and, with minus_inf, -inf in [vocab / 2, nan_begin): NaN singly, as
// vectors, a row's tail or a shard, beside -inf; token 1 stays finite.
Problem nan_span_problem(int64_t vocab, int64_t nan_begin, int64_t nan_end, bool minus_inf, DataType dtype,
                         float stddev = 3.0f);

struct RankOutputs {
  std::vector<float> loss;  // [N] for kNone, [1] otherwise
  std::vector<double> lse;  // as RunOptions::lse_dtype keeps it, widened
  std::vector<float> target_is_argmax, entropy;
};

struct RunResult {
  std::vector<Status> status;         // per rank
  std::vector<RankOutputs> per_rank;  // per rank
  std::vector<double> grad;           // [N, V], gathered from every rank's columns
};

struct RunOptions {
  LossOptions loss;
  bool in_place = false;
  DataType grad_dtype = kFloat32;  // out of place only
  bool staged = false;             // use the staged API instead of forward()
  bool extras = false;             // ask for target_is_argmax and entropy
  std::vector<float> weights;      // per-token weights, or empty for none
  float grad_scalar = 1.0f;        // the upstream gradient of a reduced loss
  DataType lse_dtype = kFloat64;   // the lse kept between forward and backward (or kFloat32)
};

// Runs forward and backward on one ThreadGroup of shards.size() ranks.
RunResult run_ranks(Problem& problem, const std::vector<VocabShard>& shards, const RunOptions& options);

// The pieces of run_ranks, for other backends: outputs filled with NaN for `ranks` ranks;
// one rank's forward and backward on `comm` (the gradient goes into `grad`, a buffer from
// grad_buffer(), or into the problem's own logits in place); and the [N, V] gradient as
// doubles, read from wherever run_rank wrote it.
RunResult empty_result(int ranks, int64_t n, bool reduced);
Status run_rank(Communicator& comm, Problem& problem, const VocabShard& shard, const RunOptions& options,
                RankOutputs* mine, std::byte* grad);
std::vector<std::byte> grad_buffer(const Problem& problem, const RunOptions& options);
std::vector<double> gathered_grad(const Problem& problem, const RunOptions& options,
                                  const std::vector<std::byte>& grad);

// A group of one rank on the calling thread: all_gather copies `send` into `recv`.
class Loopback final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status all_gather(const void* send, void* recv, std::size_t bytes) override;
  const char* name() const override { return "loopback"; }
};

// Counts the collectives that pass through it to `inner`.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const char* name() const override { return "counting"; }
  Status all_gather(const void* send, void* recv, std::size_t bytes) override {
    ++calls;
    return inner_.all_gather(send, recv, bytes);
  }
  int calls = 0;

 private:
  Communicator& inner_;
};

// The oracle's options for vpce's.
reference::Options reference_options(const LossOptions& options);

// The oracle on the same problem and options, as the test runner uses them.
reference::Result oracle(const Problem& problem, const RunOptions& options);

// max |a - b| / max |b| (or max |a - b| when b is all zero).
double relative_error(const std::vector<double>& a, const std::vector<double>& b);
std::vector<double> widen(const std::vector<float>& v);
inline const std::vector<double>& widen(const std::vector<double>& v) { return v; }

// The SIMD variants the kernels' tests run one at a time: every target Highway compiled and
// this CPU runs and, on a CPU with AVX512-BF16, AVX3 a second time without those
// instructions (the software bf16 rounding that the AVX-512 CPUs without them take).
struct SimdVariant {
  int64_t target;          // a Highway target (HWY_AVX3, ...)
  bool bf16_instructions;  // whether AVX512-BF16's instructions may be used
  std::string name;        // "AVX3", "AVX3 without AVX512-BF16", "AVX2", ...
};
std::vector<SimdVariant> simd_variants();
// Makes the kernels run as `variant` until the next call; use_best_simd_variant() goes back
// to what the CPU runs by default.
void use_simd_variant(const SimdVariant& variant);
void use_best_simd_variant();

}  // namespace vpce::test
