// tools/run_command.cc: `vpce run`: reads logits and targets from .npy files, splits the
// vocabulary over R in-process ranks (strided views into one [N, V] buffer), runs the
// forward and backward on every rank, checks that the ranks agree, writes the outputs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>

#include "commands.h"
#include "cpu/dtype.h"
#include "npy.h"
#include "vpce/vpce.h"

namespace vpce::tools {
namespace {

using detail::BFloat16;
using detail::Float16;

Status usage(const std::string& message) { return {Code::kInvalidArgument, message}; }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "(";
  for (std::size_t d = 0; d < shape.size(); ++d) text += (d ? ", " : "") + std::to_string(shape[d]);
  return text + ")";
}

// The logits in the compute dtype: a [N, V] buffer of 2- or 4-byte elements.
struct ComputeBuffer {
  DataType dtype;
  std::vector<std::byte> bytes;
  std::byte* data() { return bytes.data(); }
};

template <class T>
void convert_into(const npy::Array& in, ComputeBuffer* out) {
  const int64_t n = in.numel();
  out->bytes.resize(static_cast<std::size_t>(n) * sizeof(T));
  T* dst = reinterpret_cast<T*>(out->bytes.data());
  for (int64_t i = 0; i < n; ++i) {
    const float x = in.dtype == npy::Dtype::kFloat32 ? in.as<float>()[i]
                                                     : detail::to_float(in.as<Float16>()[i]);
    dst[i] = detail::from_float<T>(x);
  }
}

Status make_compute_buffer(const npy::Array& logits, const std::string& dtype, ComputeBuffer* out) {
  std::string chosen = dtype;
  if (chosen.empty()) chosen = logits.dtype == npy::Dtype::kFloat32 ? "fp32" : "fp16";
  if (chosen == "fp32") {
    out->dtype = kFloat32;
    convert_into<float>(logits, out);
  } else if (chosen == "bf16") {
    out->dtype = kBFloat16;
    convert_into<BFloat16>(logits, out);
  } else if (chosen == "fp16") {
    out->dtype = kFloat16;
    convert_into<Float16>(logits, out);
  } else {
    return usage("--dtype: expected fp32, bf16 or fp16, got " + chosen);
  }
  return {};
}

Status vocab_ranges(const RunConfig& config, int64_t vocab, std::vector<VocabShard>* out) {
  std::vector<int64_t> sizes = config.vocab_splits;
  if (sizes.empty()) {
    const int64_t r = config.ranks;
    for (int64_t i = 0; i < r; ++i) sizes.push_back(vocab / r + (i < vocab % r ? 1 : 0));
  }
  if (sizes.size() > 4096) {
    return usage("--vocab-splits: expected at most 4096 shards, got " + std::to_string(sizes.size()));
  }
  int64_t begin = 0;
  for (int64_t size : sizes) {
    if (size < 0) return usage("--vocab-splits: expected sizes >= 0, got " + std::to_string(size));
    out->push_back(VocabShard{begin, begin + size, vocab});
    begin += size;
  }
  if (begin != vocab) {
    return usage("--vocab-splits: expected sizes summing to V = " + std::to_string(vocab) + ", got " +
                 std::to_string(begin));
  }
  return {};
}

// A float32 .npy with `shape`, or (when `scalar_ok`) a single value of any shape.
Status read_tokens_file(const std::string& path, const std::vector<int64_t>& shape, bool scalar, npy::Array* out) {
  if (Status s = npy::read(path, out); !s.ok()) return s;
  const bool fits = scalar ? out->numel() == 1 : out->shape == shape;
  if (out->dtype != npy::Dtype::kFloat32 || !fits) {
    return usage(path + ": expected float32 with " + (scalar ? std::string("one element") : "shape " + shape_text(shape)) +
                 ", got " + npy::descr(out->dtype) + " " + shape_text(out->shape));
  }
  return {};
}

struct Inputs {
  npy::Array logits, targets, grad_output, weights;
};

Status read_inputs(const RunConfig& config, Inputs* in) {
  if (Status s = npy::read(config.logits_path, &in->logits); !s.ok()) return s;
  const npy::Array& logits = in->logits;
  if (logits.dtype != npy::Dtype::kFloat32 && logits.dtype != npy::Dtype::kFloat16) {
    return usage(config.logits_path + ": dtype: expected float32 or float16, got " + npy::descr(logits.dtype));
  }
  if (logits.shape.empty() || logits.shape.size() > 8) {
    return usage(config.logits_path + ": shape: expected [..., V] with 1 to 8 dimensions, got " +
                 shape_text(logits.shape));
  }
  if (logits.shape.back() < 1) return usage(config.logits_path + ": shape: expected V >= 1, got 0");
  if (Status s = npy::read(config.targets_path, &in->targets); !s.ok()) return s;
  if (in->targets.dtype != npy::Dtype::kInt32 && in->targets.dtype != npy::Dtype::kInt64) {
    return usage(config.targets_path + ": dtype: expected int32 or int64, got " + npy::descr(in->targets.dtype));
  }
  const std::vector<int64_t> leading(logits.shape.begin(), logits.shape.end() - 1);
  if (in->targets.shape != leading) {
    return usage(config.targets_path + ": shape: expected " + shape_text(leading) +
                 " (the logits' leading shape), got " + shape_text(in->targets.shape));
  }
  if (!config.grad_output_path.empty()) {
    const bool scalar = config.loss.reduction != Reduction::kNone;
    if (Status s = read_tokens_file(config.grad_output_path, leading, scalar, &in->grad_output); !s.ok()) return s;
  }
  if (!config.weights_path.empty()) {
    if (Status s = read_tokens_file(config.weights_path, leading, false, &in->weights); !s.ok()) return s;
  }
  return {};
}

// Per-rank outputs of the forward.
struct RankOutputs {
  std::vector<float> loss, lse, target_is_argmax, entropy;
};

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

}  // namespace

Status run_command(const RunConfig& config) {
  Inputs in;
  if (Status s = read_inputs(config, &in); !s.ok()) return s;
  const int64_t vocab = in.logits.shape.back();
  const int64_t tokens = in.logits.numel() / vocab;
  const std::vector<int64_t>& token_shape = in.targets.shape;
  std::vector<VocabShard> shards;
  if (Status s = vocab_ranges(config, vocab, &shards); !s.ok()) return s;
  const int ranks = static_cast<int>(shards.size());
  const bool reduced = config.loss.reduction != Reduction::kNone;

  ComputeBuffer logits;
  if (Status s = make_compute_buffer(in.logits, config.dtype, &logits); !s.ok()) return s;
  std::vector<float> grad_out_of_place(config.in_place ? 0 : static_cast<std::size_t>(tokens * vocab));
  std::vector<float> ones(static_cast<std::size_t>(std::max<int64_t>(tokens, 1)), 1.0f);  // >= 1: a reduction's
  const float* upstream = config.grad_output_path.empty() ? ones.data() : in.grad_output.as<float>();
  const TensorView weights = TensorView::contiguous(in.weights.data.data(), kFloat32, {tokens});
  std::vector<RankOutputs> outputs(static_cast<std::size_t>(ranks));
  for (RankOutputs& o : outputs) {
    o.loss.resize(reduced ? 1 : static_cast<std::size_t>(tokens));
    o.lse.resize(static_cast<std::size_t>(tokens));
    o.target_is_argmax.resize(config.extras ? static_cast<std::size_t>(tokens) : 0);
    o.entropy.resize(config.extras ? static_cast<std::size_t>(tokens) : 0);
  }

  const DataType target_dtype = in.targets.dtype == npy::Dtype::kInt64 ? kInt64 : kInt32;
  const int hardware = std::max(1u, std::thread::hardware_concurrency());
  LossOptions options = config.loss;
  if (options.num_threads == 0) options.num_threads = std::max(1, hardware / ranks);

  std::unique_ptr<ThreadGroup> group;
  if (Status s = ThreadGroup::create(ranks, &group); !s.ok()) return s;
  const int element = logits.dtype.bytes();
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Status> results = group->run([&](Communicator& comm) -> Status {
    const auto r = static_cast<std::size_t>(comm.rank());
    RankOutputs& out = outputs[r];
    const VocabShard& shard = shards[r];
    const int64_t cols = shard.vocab_end - shard.vocab_begin;
    const TensorView x = TensorView::matrix(logits.data() + shard.vocab_begin * element, logits.dtype, tokens, cols, vocab);
    const TensorView y = TensorView::contiguous(in.targets.data.data(), target_dtype, {tokens});
    const TensorView loss = TensorView::contiguous(out.loss.data(), kFloat32, {static_cast<int64_t>(out.loss.size())});
    const TensorView lse = TensorView::contiguous(out.lse.data(), kFloat32, {tokens});
    const TensorView argmax = TensorView::contiguous(out.target_is_argmax.data(), kFloat32, {tokens});
    const TensorView entropy = TensorView::contiguous(out.entropy.data(), kFloat32, {tokens});
    ForwardExtras extras;
    extras.weights = config.weights_path.empty() ? nullptr : &weights;
    if (config.extras) {
      extras.target_is_argmax = &argmax;
      extras.entropy = &entropy;
    }
    if (Status s = forward(comm, x, y, shard, options, loss, lse, extras); !s.ok()) return s;
    const TensorView g = TensorView::contiguous(upstream, kFloat32, {reduced ? 1 : tokens});
    const TensorView grad = config.in_place ? x
                                            : TensorView::matrix(grad_out_of_place.data() + shard.vocab_begin, kFloat32,
                                                                 tokens, cols, vocab);
    return backward(x, y, lse, g, shard, options, grad, extras.weights);
  });
  const double elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  for (const Status& s : results) {
    if (!s.ok()) return s;
  }

  std::vector<float> grad_full;
  const float* grad_data = grad_out_of_place.data();
  if (config.in_place) {
    grad_full.resize(static_cast<std::size_t>(tokens * vocab));
    const int element_bytes = logits.dtype.bytes();
    for (std::size_t i = 0; i < grad_full.size(); ++i) {
      grad_full[i] = detail::widen(logits.data() + i * static_cast<std::size_t>(element_bytes), logits.dtype);
    }
    grad_data = grad_full.data();
  }
  std::error_code error;
  std::filesystem::create_directories(config.out_dir, error);
  if (error) return {Code::kSystemError, config.out_dir + ": cannot create the directory: " + error.message()};
  const std::string dir = config.out_dir + "/";
  const RankOutputs& first = outputs[0];
  const std::vector<int64_t> loss_shape = reduced ? std::vector<int64_t>{} : token_shape;
  if (Status s = npy::write(dir + "loss.npy", npy::Dtype::kFloat32, loss_shape, first.loss.data()); !s.ok()) return s;
  if (Status s = npy::write(dir + "lse.npy", npy::Dtype::kFloat32, token_shape, first.lse.data()); !s.ok()) return s;
  if (Status s = npy::write(dir + "grad_logits.npy", npy::Dtype::kFloat32, in.logits.shape, grad_data); !s.ok()) return s;
  if (config.extras) {
    if (Status s = npy::write(dir + "target_is_argmax.npy", npy::Dtype::kFloat32, token_shape, first.target_is_argmax.data());
        !s.ok()) {
      return s;
    }
    if (Status s = npy::write(dir + "entropy.npy", npy::Dtype::kFloat32, token_shape, first.entropy.data()); !s.ok()) return s;
  }

  double loss_value = 0.0;  // the reduced loss, or the mean of the per-token losses
  for (float l : first.loss) loss_value += static_cast<double>(l);
  if (!reduced && tokens > 0) loss_value /= static_cast<double>(tokens);
  const char* loss_label = config.loss.reduction == Reduction::kSum    ? "sum loss"
                           : config.loss.reduction == Reduction::kMean ? "mean loss"
                                                                       : "mean token loss";
  std::printf("vpce run: tokens %lld  V %lld  R %d  dtype %s  %s %.6f  max rank loss difference %g  time %.3f ms (forward + backward)\n",
              static_cast<long long>(tokens), static_cast<long long>(vocab), ranks, to_string(logits.dtype).c_str(),
              loss_label, loss_value, max_rank_difference(outputs), elapsed_ms);
  return {};
}

}  // namespace vpce::tools
