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

float element_as_float(const ComputeBuffer& buffer, std::size_t i) {
  if (buffer.dtype == kFloat32) return reinterpret_cast<const float*>(buffer.bytes.data())[i];
  if (buffer.dtype == kBFloat16) {
    return detail::to_float(reinterpret_cast<const BFloat16*>(buffer.bytes.data())[i]);
  }
  return detail::to_float(reinterpret_cast<const Float16*>(buffer.bytes.data())[i]);
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

Status read_inputs(const RunConfig& config, npy::Array* logits, npy::Array* targets,
                   npy::Array* grad_output) {
  if (Status s = npy::read(config.logits_path, logits); !s.ok()) return s;
  if (logits->dtype != npy::Dtype::kFloat32 && logits->dtype != npy::Dtype::kFloat16) {
    return usage(config.logits_path + ": dtype: expected float32 or float16, got " +
                 npy::descr(logits->dtype));
  }
  if (logits->shape.empty() || logits->shape.size() > 8) {
    return usage(config.logits_path + ": shape: expected [..., V] with 1 to 8 dimensions, got " +
                 shape_text(logits->shape));
  }
  if (logits->shape.back() < 1) return usage(config.logits_path + ": shape: expected V >= 1, got 0");
  if (Status s = npy::read(config.targets_path, targets); !s.ok()) return s;
  if (targets->dtype != npy::Dtype::kInt32 && targets->dtype != npy::Dtype::kInt64) {
    return usage(config.targets_path + ": dtype: expected int32 or int64, got " +
                 npy::descr(targets->dtype));
  }
  const std::vector<int64_t> leading(logits->shape.begin(), logits->shape.end() - 1);
  if (targets->shape != leading) {
    return usage(config.targets_path + ": shape: expected " + shape_text(leading) +
                 " (the logits' leading shape), got " + shape_text(targets->shape));
  }
  if (!config.grad_output_path.empty()) {
    if (Status s = npy::read(config.grad_output_path, grad_output); !s.ok()) return s;
    if (grad_output->dtype != npy::Dtype::kFloat32 || grad_output->shape != leading) {
      return usage(config.grad_output_path + ": expected float32 with shape " + shape_text(leading) +
                   ", got " + npy::descr(grad_output->dtype) + " " + shape_text(grad_output->shape));
    }
  }
  return {};
}

}  // namespace

Status run_command(const RunConfig& config) {
  npy::Array logits_file;
  npy::Array targets_file;
  npy::Array grad_output_file;
  if (Status s = read_inputs(config, &logits_file, &targets_file, &grad_output_file); !s.ok()) return s;
  const int64_t vocab = logits_file.shape.back();
  const int64_t tokens = logits_file.numel() / vocab;
  std::vector<VocabShard> shards;
  if (Status s = vocab_ranges(config, vocab, &shards); !s.ok()) return s;
  const int ranks = static_cast<int>(shards.size());

  ComputeBuffer logits;
  if (Status s = make_compute_buffer(logits_file, config.dtype, &logits); !s.ok()) return s;
  std::vector<float> grad_out_of_place(config.in_place ? 0 : static_cast<std::size_t>(tokens * vocab));
  std::vector<float> ones(static_cast<std::size_t>(tokens), 1.0f);
  const float* upstream = config.grad_output_path.empty() ? ones.data() : grad_output_file.as<float>();
  std::vector<std::vector<float>> loss(static_cast<std::size_t>(ranks), std::vector<float>(static_cast<std::size_t>(tokens)));
  std::vector<std::vector<float>> lse = loss;

  const DataType target_dtype = targets_file.dtype == npy::Dtype::kInt64 ? kInt64 : kInt32;
  const int hardware = std::max(1u, std::thread::hardware_concurrency());
  LossOptions options;
  options.label_smoothing = config.label_smoothing;
  options.num_threads = config.threads_per_rank > 0 ? config.threads_per_rank : std::max(1, hardware / ranks);

  std::unique_ptr<ThreadGroup> group;
  if (Status s = ThreadGroup::create(ranks, &group); !s.ok()) return s;
  const int element = logits.dtype.bytes();
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Status> results = group->run([&](Communicator& comm) -> Status {
    const auto r = static_cast<std::size_t>(comm.rank());
    const VocabShard& shard = shards[r];
    const int64_t cols = shard.vocab_end - shard.vocab_begin;
    const TensorView x = TensorView::matrix(logits.data() + shard.vocab_begin * element, logits.dtype,
                                            tokens, cols, vocab);
    const TensorView y = TensorView::contiguous(targets_file.data.data(), target_dtype, {tokens});
    const TensorView loss_view = TensorView::contiguous(loss[r].data(), kFloat32, {tokens});
    const TensorView lse_view = TensorView::contiguous(lse[r].data(), kFloat32, {tokens});
    if (Status s = forward(comm, x, y, shard, options, loss_view, lse_view); !s.ok()) return s;
    const TensorView g = TensorView::contiguous(upstream, kFloat32, {tokens});
    const TensorView grad = config.in_place
                                ? x
                                : TensorView::matrix(grad_out_of_place.data() + shard.vocab_begin,
                                                     kFloat32, tokens, cols, vocab);
    return backward(x, y, lse_view, g, shard, options, grad);
  });
  const double elapsed_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < ranks; ++r) {
    if (!results[static_cast<std::size_t>(r)].ok()) return results[static_cast<std::size_t>(r)];
  }

  double max_rank_difference = 0.0;
  for (int r = 1; r < ranks; ++r) {
    for (int64_t i = 0; i < tokens; ++i) {
      const double a = loss[0][static_cast<std::size_t>(i)];
      const double b = loss[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)];
      const bool same_bits = std::memcmp(&loss[0][static_cast<std::size_t>(i)],
                                         &loss[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)],
                                         sizeof(float)) == 0;
      if (!same_bits) {
        const double difference = std::fabs(a - b);
        max_rank_difference = std::max(max_rank_difference,
                                       std::isnan(difference) ? HUGE_VAL : difference);
      }
    }
  }
  double total = 0.0;
  for (float l : loss[0]) total += static_cast<double>(l);

  std::vector<float> grad_full;
  const float* grad_data = grad_out_of_place.data();
  if (config.in_place) {
    grad_full.resize(static_cast<std::size_t>(tokens * vocab));
    for (std::size_t i = 0; i < grad_full.size(); ++i) grad_full[i] = element_as_float(logits, i);
    grad_data = grad_full.data();
  }
  std::error_code error;
  std::filesystem::create_directories(config.out_dir, error);
  if (error) return {Code::kSystemError, config.out_dir + ": cannot create the directory: " + error.message()};
  const std::string dir = config.out_dir + "/";
  if (Status s = npy::write(dir + "loss.npy", npy::Dtype::kFloat32, targets_file.shape, loss[0].data()); !s.ok()) return s;
  if (Status s = npy::write(dir + "lse.npy", npy::Dtype::kFloat32, targets_file.shape, lse[0].data()); !s.ok()) return s;
  if (Status s = npy::write(dir + "grad_logits.npy", npy::Dtype::kFloat32, logits_file.shape, grad_data); !s.ok()) return s;

  std::printf("vpce run: tokens %lld  V %lld  R %d  dtype %s  mean loss %.6f  max rank loss difference %g  time %.3f ms (forward + backward)\n",
              static_cast<long long>(tokens), static_cast<long long>(vocab), ranks,
              to_string(logits.dtype).c_str(), tokens > 0 ? total / static_cast<double>(tokens) : 0.0,
              max_rank_difference, elapsed_ms);
  return {};
}

}  // namespace vpce::tools
