// tools/run_command.cc: `vpce run` on the in-process backend: reads logits and targets from
// .npy files, splits the vocabulary over R ranks (strided views into one [N, V] buffer),
// runs the forward and backward on every rank, checks that the ranks agree, writes the
// outputs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "checks.h"
#include "cpu/dtype.h"
#include "rank_threads.h"
#include "run_io.h"

namespace vpce::tools {
namespace {

// The largest difference between rank 0's loss and any other rank's (0 when bit-identical).
double max_rank_difference(const std::vector<RankOutputs>& outputs) {
  double worst = 0.0;
  for (const RankOutputs& other : outputs) {
    for (std::size_t i = 0; i < other.loss.size(); ++i) {
      const float a = outputs[0].loss[i];
      const float b = other.loss[i];
      if (std::memcmp(&a, &b, sizeof(float)) == 0) continue;
      const double difference = std::fabs(static_cast<double>(a) - static_cast<double>(b));
      worst = std::max(worst, std::isnan(difference) ? HUGE_VAL : difference);
    }
  }
  return worst;
}

Status run_threads(const RunConfig& config, const npy::Info& info) {
  const std::vector<int64_t> leading(info.shape.begin(), info.shape.end() - 1);
  TokenInputs in;
  if (Status s = read_token_inputs(config, leading, &in); !s.ok()) return s;
  npy::Array logits_file;
  if (Status s = npy::read(config.logits_path, &logits_file); !s.ok()) return s;
  const int64_t vocab = info.shape.back();
  const int64_t tokens = logits_file.numel() / vocab;
  std::vector<VocabShard> shards;
  if (Status s = vocab_ranges(config, config.ranks, vocab, &shards); !s.ok()) return s;
  const int ranks = static_cast<int>(shards.size());
  const bool reduced = config.loss.reduction != Reduction::kNone;

  ComputeBuffer logits;
  if (Status s = make_compute_buffer(logits_file, config.dtype, &logits); !s.ok()) return s;
  logits_file = {};
  std::vector<float> grad_out_of_place(config.in_place ? 0 : static_cast<std::size_t>(tokens * vocab));
  std::vector<float> ones(static_cast<std::size_t>(std::max<int64_t>(tokens, 1)), 1.0f);  // >= 1: a reduction's
  const float* upstream = config.grad_output_path.empty() ? ones.data() : in.grad_output.as<float>();
  const TensorView weights = TensorView::contiguous(in.weights.data.data(), kFloat32, {tokens});
  std::vector<RankOutputs> outputs(static_cast<std::size_t>(ranks), make_rank_outputs(config, tokens));

  const DataType target_dtype = in.targets.dtype == npy::Dtype::kInt64 ? kInt64 : kInt32;
  const int hardware = std::max(1u, std::thread::hardware_concurrency());
  LossOptions options = config.loss;
  if (options.num_threads == 0) options.num_threads = std::max(1, hardware / ranks);

  std::unique_ptr<ThreadGroup> group;
  if (Status s = ThreadGroup::create(ranks, &group, std::chrono::seconds(config.timeout_s)); !s.ok()) return s;
  const int element = logits.dtype.bytes();
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> results;
  const Status started = run_on_threads(
      *group,
      [&](Communicator& comm) -> Status {
        const auto r = static_cast<std::size_t>(comm.rank());
        RankOutputs& out = outputs[r];
        const VocabShard& shard = shards[r];
        const int64_t cols = shard.vocab_end - shard.vocab_begin;
        const TensorView x =
            TensorView::matrix(logits.data() + shard.vocab_begin * element, logits.dtype, tokens, cols, vocab);
        const TensorView y = TensorView::contiguous(in.targets.data.data(), target_dtype, {tokens});
        const ForwardOutputs views(config, out, tokens, &weights);
        if (Status s = forward(comm, x, y, shard, options, views.loss, views.lse, views.extras); !s.ok()) return s;
        const TensorView g = TensorView::contiguous(upstream, kFloat32, {reduced ? 1 : tokens});
        const TensorView grad = config.in_place ? x
                                                : TensorView::matrix(grad_out_of_place.data() + shard.vocab_begin,
                                                                     kFloat32, tokens, cols, vocab);
        return backward(x, y, views.lse, g, shard, options, grad, views.extras.weights);
      },
      config.vocab_splits.empty() ? "--tp" : "--vocab-splits", &results);
  if (!started.ok()) return started;
  const double elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  for (const Status& s : results) {
    if (!s.ok()) return s;
  }

  std::vector<float> grad_full;
  const float* grad_data = grad_out_of_place.data();
  if (config.in_place) {
    grad_full.resize(static_cast<std::size_t>(tokens * vocab));
    for (std::size_t i = 0; i < grad_full.size(); ++i) {
      grad_full[i] = detail::widen(logits.data() + i * static_cast<std::size_t>(element), logits.dtype);
    }
    grad_data = grad_full.data();
  }
  char tail[128];
  std::snprintf(tail, sizeof(tail), "max rank loss difference %g  time %.3f ms (forward + backward)",
                max_rank_difference(outputs), elapsed_ms);
  return write_outputs(config, info.shape, outputs[0], grad_data,
                       "R " + std::to_string(ranks) + "  dtype " + to_string(logits.dtype), tail);
}

}  // namespace

Status run_command(const RunConfig& config) {
  if (Status s = check_threads("--threads", config.loss.num_threads); !s.ok()) return s;
  npy::Info info;
  if (Status s = read_logits_info(config, &info); !s.ok()) return s;
  return catch_out_of_memory("run: " + memory_needed(config, info), [&] { return run_threads(config, info); });
}

}  // namespace vpce::tools
