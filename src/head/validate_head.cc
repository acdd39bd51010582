// head/validate_head.cc: the fused head's argument checks (see head_args.h).
#include <string>

#include "../common/values_hash.h"
#include "head_args.h"

namespace vpce::detail {
namespace {

constexpr int64_t kDefaultTokenBlock = 512;
constexpr int64_t kDefaultVocabBlock = 1024;
constexpr int64_t kMaxBlock = 16384;  // a tile row is one of the kernels' blocks
constexpr int64_t kDefaultChunkBytes = int64_t{128} << 20;

Status check_block(const char* name, int64_t value) {
  if (value < 0 || value > kMaxBlock) {
    return {Code::kInvalidArgument,
            expected_got(name, "0 (the default) or a value in [1, " + std::to_string(kMaxBlock) + "]",
                         std::to_string(value))};
  }
  return {};
}

Status resolve_tiles(const HeadOptions& head, int64_t vocab_rows, HeadTiles* out) {
  if (Status s = check_block("head.token_block", head.token_block); !s.ok()) return s;
  if (Status s = check_block("head.vocab_block", head.vocab_block); !s.ok()) return s;
  if (head.chunk_tokens < 0) {
    return {Code::kInvalidArgument,
            expected_got("head.chunk_tokens", "0 (the default) or a positive multiple of the token block",
                         std::to_string(head.chunk_tokens))};
  }
  HeadTiles t;
  t.token_block = head.token_block > 0 ? head.token_block : kDefaultTokenBlock;
  t.vocab_block = head.vocab_block > 0 ? head.vocab_block : kDefaultVocabBlock;
  if (vocab_rows > 0 && t.vocab_block > vocab_rows) t.vocab_block = vocab_rows;
  if (head.chunk_tokens > 0) {
    if (head.chunk_tokens % t.token_block != 0) {
      return {Code::kInvalidArgument,
              expected_got("head.chunk_tokens", "a multiple of the token block " + std::to_string(t.token_block),
                           std::to_string(head.chunk_tokens))};
    }
  }
  *out = t;
  return {};
}

}  // namespace

int64_t agreed_vocab_rows(const VocabShard& shard, int ranks) {
  return ranks > 0 && shard.vocab_size > 0 ? (shard.vocab_size + ranks - 1) / ranks : 1;
}

int64_t agreed_chunk_tokens(const HeadOptions& head, const VocabShard& shard, int ranks) {
  if (head.chunk_tokens > 0) return head.chunk_tokens;
  const int64_t nb = head.token_block > 0 && head.token_block <= kMaxBlock ? head.token_block : kDefaultTokenBlock;
  const int64_t blocks =
      kDefaultChunkBytes / static_cast<int64_t>(sizeof(float)) / agreed_vocab_rows(shard, ranks) / nb;
  return (blocks > 1 ? blocks : 1) * nb;
}

Status check_head_inputs(const HeadInputs& inputs, const TensorView& targets, const TensorView* weights,
                         const VocabShard& shard, const LossOptions& options, const HeadOptions& head, HeadArgs* out) {
  HeadArgs a;
  const TensorView& hidden = inputs.hidden;
  const TensorView& weight = inputs.weight;
  if (Status s = device_supported(hidden.device, "hidden"); !s.ok()) return s;
  if (Status s = check_dtype("hidden", hidden.dtype, {kFloat32, kBFloat16, kFloat16}, "float32, bfloat16 or float16");
      !s.ok()) {
    return s;
  }
  if (Status s = as_row_matrix(hidden, "hidden", &a.hidden); !s.ok()) return s;
  if (Status s = check_device(weight, "weight", hidden.device); !s.ok()) return s;
  if (weight.dtype != hidden.dtype) {
    return {Code::kInvalidArgument,
            expected_got("weight.dtype", to_string(hidden.dtype) + " (hidden's dtype)", to_string(weight.dtype))};
  }
  if (weight.ndim != 2) {
    return {Code::kInvalidArgument,
            expected_got("weight.ndim", "2 ([vocab_end - vocab_begin, H])", std::to_string(weight.ndim))};
  }
  if (Status s = as_row_matrix(weight, "weight", &a.weight); !s.ok()) return s;
  if (a.weight.cols != a.hidden.cols) {
    return {Code::kInvalidArgument, expected_got("weight.shape[1]", std::to_string(a.hidden.cols) + " (hidden's H)",
                                                 std::to_string(a.weight.cols))};
  }
  if (Status s = check_shard(shard, shard.vocab_end - shard.vocab_begin, "weight"); !s.ok()) return s;
  if (a.weight.rows != shard.vocab_end - shard.vocab_begin) {
    return {Code::kInvalidArgument,
            expected_got("weight.shape[0]",
                         std::to_string(shard.vocab_end - shard.vocab_begin) + " (shard.vocab_end - shard.vocab_begin)",
                         std::to_string(a.weight.rows))};
  }
  if (inputs.bias != nullptr) {
    const TensorView& bias = *inputs.bias;
    if (Status s = check_device(bias, "bias", hidden.device); !s.ok()) return s;
    if (bias.dtype != hidden.dtype) {
      return {Code::kInvalidArgument,
              expected_got("bias.dtype", to_string(hidden.dtype) + " (hidden's dtype)", to_string(bias.dtype))};
    }
    if (bias.ndim >= 0 && bias.ndim <= TensorView::kMaxDims && bias.numel() != a.weight.rows) {
      return {Code::kInvalidArgument,
              expected_got("bias.shape", std::to_string(a.weight.rows) + " elements (one per weight row)",
                           std::to_string(bias.numel()) + " elements")};
    }
    if (Status s = as_token_vector(bias, "bias", a.weight.rows, &a.bias); !s.ok()) return s;
    a.has_bias = true;
  }
  if (Status s = check_options(options, shard); !s.ok()) return s;
  if (Status s = resolve_tiles(head, a.weight.rows, &a.tiles); !s.ok()) return s;
  if (head.bf16_logit_gradients && hidden.dtype != kBFloat16) {
    return {Code::kInvalidArgument,
            expected_got("head.bf16_logit_gradients",
                         "false for " + to_string(hidden.dtype) + " operands (bfloat16 only)", "true")};
  }
  a.bf16_logit_gradients = head.bf16_logit_gradients;
  a.round_logits = head.round_logits && hidden.dtype != kFloat32;
  if (Status s = check_dtype("targets", targets.dtype, {kInt32, kInt64}, "int32 or int64"); !s.ok()) return s;
  if (Status s = as_token_vector(targets, "targets", a.hidden.rows, &a.targets); !s.ok()) return s;
  if (Status s = check_device(targets, "targets", hidden.device); !s.ok()) return s;
  if (weights != nullptr) {
    if (Status s = check_device(*weights, "weights", hidden.device); !s.ok()) return s;
  }
  a.inputs_hash = kValuesHashSeed;  // as check_loss_inputs
  if (hidden.device.type != DeviceType::kCPU) {
    if (Status s = as_weights(weights, a.hidden.rows, &a.weights); !s.ok()) return s;
    *out = a;
    return {};
  }
  const int64_t valid = options.valid_vocab_size > 0 ? options.valid_vocab_size : shard.vocab_size;
  if (Status s = check_targets(a.targets, valid, options.ignore_index, &a.inputs_hash); !s.ok()) return s;
  if (Status s = check_weights(weights, a.hidden.rows, &a.weights, &a.inputs_hash); !s.ok()) return s;
  *out = a;
  return {};
}

std::vector<NamedRegion> input_regions(const HeadArgs& args) {
  std::vector<NamedRegion> r = {{"hidden", args.hidden.begin_byte(), args.hidden.end_byte()},
                                {"weight", args.weight.begin_byte(), args.weight.end_byte()},
                                {"targets", args.targets.base, args.targets.end_byte()}};
  if (args.bias.base != nullptr) r.push_back({"bias", args.bias.base, args.bias.end_byte()});
  if (args.weights.base != nullptr) r.push_back({"weights", args.weights.base, args.weights.end_byte()});
  return r;
}

Status check_head_gradients(const HeadGradients& gradients, const HeadArgs& args,
                            const std::vector<NamedRegion>& inputs, HeadGradientArgs* out) {
  return check_head_gradients(
      gradients, args, inputs, [](const TensorView& t, const char* name) { return check_device(t, name, Device{}); },
      out);
}

Status check_head_gradients(const HeadGradients& gradients, const HeadArgs& args,
                            const std::vector<NamedRegion>& inputs,
                            const std::function<Status(const TensorView&, const char*)>& check_place,
                            HeadGradientArgs* out) {
  HeadGradientArgs g;
  const DataType dtype = args.hidden.dtype;
  auto check_one = [&](const char* name, const GradientOutput& o) -> Status {
    if (Status s = check_place(*o.tensor, name); !s.ok()) return s;
    if (o.accumulate) return check_dtype(name, o.tensor->dtype, {kFloat32}, "float32 (accumulate adds into fp32)");
    if (o.tensor->dtype == kFloat32 || o.tensor->dtype == dtype) return {};
    return {Code::kInvalidArgument,
            expected_got((std::string(name) + ".dtype").c_str(), "float32 or " + to_string(dtype) + " (the input's)",
                         to_string(o.tensor->dtype))};
  };
  // grad_hidden and grad_weight: [rows, cols] like `like`, the input named `of`.
  auto check_matrix = [&](const char* name, const GradientOutput& o, const RowMatrix& like, const char* of,
                          GradientArgs* m) -> Status {
    if (Status s = check_one(name, o); !s.ok()) return s;
    if (Status s = as_row_matrix(*o.tensor, name, &m->matrix); !s.ok()) return s;
    if (m->matrix.rows != like.rows || m->matrix.cols != like.cols) {
      auto text = [](int64_t rows, int64_t cols) { return std::to_string(rows) + " x " + std::to_string(cols); };
      return {Code::kInvalidArgument,
              expected_got((std::string(name) + ".shape").c_str(), text(like.rows, like.cols) + " (" + of + "'s)",
                           text(m->matrix.rows, m->matrix.cols))};
    }
    m->accumulate = o.accumulate;
    return {};
  };
  if (gradients.hidden.tensor != nullptr) {
    if (Status s = check_matrix("grad_hidden", gradients.hidden, args.hidden, "hidden", &g.hidden); !s.ok()) return s;
  }
  if (gradients.weight.tensor != nullptr) {
    if (gradients.weight.tensor->ndim != 2) {
      if (Status s = check_one("grad_weight", gradients.weight); !s.ok()) return s;
      return {Code::kInvalidArgument,
              expected_got("grad_weight.ndim", "2 (weight's)", std::to_string(gradients.weight.tensor->ndim))};
    }
    if (Status s = check_matrix("grad_weight", gradients.weight, args.weight, "weight", &g.weight); !s.ok()) return s;
  }
  if (gradients.bias.tensor != nullptr) {
    if (!args.has_bias) {
      return {Code::kInvalidArgument, expected_got("grad_bias", "null (there is no bias)", "a tensor")};
    }
    if (Status s = check_one("grad_bias", gradients.bias); !s.ok()) return s;
    TokenVector v;
    const TensorView& t = *gradients.bias.tensor;
    if (t.ndim >= 0 && t.ndim <= TensorView::kMaxDims && t.numel() != args.weight.rows) {
      return {Code::kInvalidArgument,
              expected_got("grad_bias.shape", std::to_string(args.weight.rows) + " elements (bias's)",
                           std::to_string(t.numel()) + " elements")};
    }
    if (Status s = as_token_vector(t, "grad_bias", args.weight.rows, &v); !s.ok()) return s;
    if (v.n > 1 && v.stride < 1) {
      return {Code::kInvalidArgument,
              expected_got("grad_bias.strides", "a positive stride (each element its own memory)",
                           std::to_string(v.stride))};
    }
    g.bias.matrix = RowMatrix{v.base, v.dtype, v.n, 1, v.stride};
    g.bias.accumulate = gradients.bias.accumulate;
  }
  std::vector<NamedRegion> outputs = {{"grad_hidden", g.hidden.matrix.begin_byte(), g.hidden.matrix.end_byte()},
                                      {"grad_weight", g.weight.matrix.begin_byte(), g.weight.matrix.end_byte()},
                                      {"grad_bias", g.bias.matrix.begin_byte(), g.bias.matrix.end_byte()}};
  if (Status s = check_no_overlap(outputs, inputs); !s.ok()) return s;
  *out = g;
  return {};
}

OperationBlock head_operation(int64_t hidden_size, bool chunked, int64_t head_tokens, float grad_loss,
                              bool round_logits) {
  return operation_block(
      "fused head",
      chunked ? "chunked (linear_cross_entropy_forward_backward)" : "recompute (linear_cross_entropy_forward)",
      {{"the hidden size of the fused head", hidden_size},
       {"the number of tokens", chunked ? head_tokens : 0},
       float_value("grad_loss (the chunked mode's upstream gradient)", chunked ? grad_loss : 0.0f),
       {"head.round_logits", round_logits ? 1 : 0}});
}

}  // namespace vpce::detail
