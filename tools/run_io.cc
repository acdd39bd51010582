// tools/run_io.cc: input checks, dtype conversion, vocabulary splits and output writing
// for `vpce run` (see run_io.h).
#include "run_io.h"

#include <cstdio>

#include "cpu/dtype.h"

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

template <class T>
void convert_into(const npy::Array& in, ComputeBuffer* out) {
  const int64_t n = in.numel();
  out->bytes.resize(static_cast<std::size_t>(n) * sizeof(T));
  T* dst = reinterpret_cast<T*>(out->bytes.data());
  for (int64_t i = 0; i < n; ++i) {
    const float x = in.dtype == npy::Dtype::kFloat32 ? in.as<float>()[i] : detail::to_float(in.as<Float16>()[i]);
    dst[i] = detail::from_float<T>(x);
  }
}

// A float32 .npy with `shape`, or (when `scalar`) a single value of any shape.
Status read_tokens_file(const std::string& path, const std::vector<int64_t>& shape, bool scalar, npy::Array* out) {
  if (Status s = npy::read(path, out); !s.ok()) return s;
  const bool fits = scalar ? out->numel() == 1 : out->shape == shape;
  if (out->dtype != npy::Dtype::kFloat32 || !fits) {
    return usage(path + ": expected float32 with " +
                 (scalar ? std::string("one element") : "shape " + shape_text(shape)) + ", got " +
                 npy::descr(out->dtype) + " " + shape_text(out->shape));
  }
  return {};
}

}  // namespace

Status read_logits_info(const RunConfig& config, npy::Info* info) {
  if (Status s = npy::read_info(config.logits_path, info); !s.ok()) return s;
  if (info->dtype != npy::Dtype::kFloat32 && info->dtype != npy::Dtype::kFloat16) {
    return usage(config.logits_path + ": dtype: expected float32 or float16, got " + npy::descr(info->dtype));
  }
  if (info->shape.empty() || info->shape.size() > 8) {
    return usage(config.logits_path + ": shape: expected [..., V] with 1 to 8 dimensions, got " +
                 shape_text(info->shape));
  }
  if (info->shape.back() < 1) return usage(config.logits_path + ": shape: expected V >= 1, got 0");
  return {};
}

std::string memory_needed(const RunConfig& config, const npy::Info& info) {
  // The file as read, its compute copy, the fp32 gradient (or its fp32 copy in place).
  const double elements = static_cast<double>(info.data_bytes) / npy::item_bytes(info.dtype);
  const double bytes = static_cast<double>(info.data_bytes) + elements * (4.0 + 4.0);
  char text[64];
  std::snprintf(text, sizeof(text), "about %.1f MiB in all", bytes / 1048576.0);
  std::string dims;
  for (int64_t d : info.shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  return config.logits_path + " ([" + dims + "] " + (info.dtype == npy::Dtype::kFloat16 ? "float16" : "float32") +
         " logits; " + text + ")";
}

Status read_token_inputs(const RunConfig& config, const std::vector<int64_t>& leading, TokenInputs* in) {
  if (Status s = npy::read(config.targets_path, &in->targets); !s.ok()) return s;
  if (in->targets.dtype != npy::Dtype::kInt32 && in->targets.dtype != npy::Dtype::kInt64) {
    return usage(config.targets_path + ": dtype: expected int32 or int64, got " + npy::descr(in->targets.dtype));
  }
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

Status vocab_ranges(const RunConfig& config, int ranks, int64_t vocab, std::vector<VocabShard>* out) {
  std::vector<int64_t> sizes = config.vocab_splits;
  if (sizes.empty()) {
    for (int64_t i = 0; i < ranks; ++i) sizes.push_back(vocab / ranks + (i < vocab % ranks ? 1 : 0));
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

RankOutputs make_rank_outputs(const RunConfig& config, int64_t tokens) {
  const bool reduced = config.loss.reduction != Reduction::kNone;
  RankOutputs o;
  o.loss.resize(reduced ? 1 : static_cast<std::size_t>(tokens));
  o.lse.resize(static_cast<std::size_t>(tokens));
  o.target_is_argmax.resize(config.extras ? static_cast<std::size_t>(tokens) : 0);
  o.entropy.resize(config.extras ? static_cast<std::size_t>(tokens) : 0);
  return o;
}

ForwardOutputs::ForwardOutputs(const RunConfig& config, RankOutputs& out, int64_t tokens, const TensorView* weights)
    : loss(TensorView::contiguous(out.loss.data(), kFloat32, {static_cast<int64_t>(out.loss.size())})),
      lse(TensorView::contiguous(out.lse.data(), kFloat64, {tokens})),
      target_is_argmax(TensorView::contiguous(out.target_is_argmax.data(), kFloat32, {tokens})),
      entropy(TensorView::contiguous(out.entropy.data(), kFloat32, {tokens})) {
  extras.weights = config.weights_path.empty() ? nullptr : weights;
  if (config.extras) {
    extras.target_is_argmax = &target_is_argmax;
    extras.entropy = &entropy;
  }
}

Status write_outputs(const RunConfig& config, const std::vector<int64_t>& logits_shape, const RankOutputs& first,
                     const float* grad, const std::string& summary_head, const std::string& summary_tail) {
  const bool reduced = config.loss.reduction != Reduction::kNone;
  const std::vector<int64_t> token_shape(logits_shape.begin(), logits_shape.end() - 1);
  const std::vector<int64_t> loss_shape = reduced ? std::vector<int64_t>{} : token_shape;
  std::vector<npy::OutputFile> files = {{"loss.npy", npy::Dtype::kFloat32, loss_shape, first.loss.data()},
                                        {"lse.npy", npy::Dtype::kFloat64, token_shape, first.lse.data()},
                                        {"grad_logits.npy", npy::Dtype::kFloat32, logits_shape, grad}};
  std::vector<std::string> stale;  // an earlier run's extras, which would pass for this one's
  if (config.extras) {
    files.push_back({"target_is_argmax.npy", npy::Dtype::kFloat32, token_shape, first.target_is_argmax.data()});
    files.push_back({"entropy.npy", npy::Dtype::kFloat32, token_shape, first.entropy.data()});
  } else {
    stale = {"target_is_argmax.npy", "entropy.npy"};
  }
  std::vector<std::string> removed;
  if (Status s = npy::write_all(config.out_dir, files, stale, &removed); !s.ok()) return s;
  for (const std::string& name : removed) {
    std::fprintf(stderr, "vpce run: removed %s/%s, an earlier run's (this run computes no extras)\n",
                 config.out_dir.c_str(), name.c_str());
  }
  const int64_t tokens = static_cast<int64_t>(first.lse.size());
  double loss_value = 0.0;  // the reduced loss, or the mean of the per-token losses
  for (float l : first.loss) loss_value += static_cast<double>(l);
  if (!reduced && tokens > 0) loss_value /= static_cast<double>(tokens);
  const char* loss_label = config.loss.reduction == Reduction::kSum    ? "sum loss"
                           : config.loss.reduction == Reduction::kMean ? "mean loss"
                                                                       : "mean of all tokens' losses";
  std::printf("vpce run: tokens %lld  V %lld  %s  %s %.6f  %s\n", static_cast<long long>(tokens),
              static_cast<long long>(logits_shape.back()), summary_head.c_str(), loss_label, loss_value,
              summary_tail.c_str());
  return {};
}

}  // namespace vpce::tools
