// tools/gen_command.cc: `vpce gen`: a random example input for `vpce run`.
#include <cmath>
#include <random>

#include "checks.h"
#include "commands.h"
#include "cpu/dtype.h"
#include "npy.h"

namespace vpce::tools {
namespace {

Status generate(const GenConfig& config, std::size_t count) {
  std::mt19937_64 rng(config.seed);
  std::normal_distribution<float> logit(0.0f, config.stddev);
  std::uniform_int_distribution<int64_t> target(0, config.vocab - 1);
  std::vector<float> logits(count);
  for (float& x : logits) x = logit(rng);
  std::vector<int64_t> targets(static_cast<std::size_t>(config.tokens));
  for (int64_t& y : targets) y = target(rng);

  const std::vector<int64_t> shape{config.tokens, config.vocab};
  std::vector<detail::Float16> half;
  npy::OutputFile logits_file{"logits.npy", npy::Dtype::kFloat32, shape, logits.data()};
  if (config.dtype == "float16") {
    half.resize(count);
    for (std::size_t i = 0; i < count; ++i) half[i] = detail::from_float<detail::Float16>(logits[i]);
    logits_file = {"logits.npy", npy::Dtype::kFloat16, shape, half.data()};
  }
  return npy::write_all(config.out_dir,
                        {logits_file, {"targets.npy", npy::Dtype::kInt64, {config.tokens}, targets.data()}});
}

}  // namespace

Status gen_command(const GenConfig& config) {
  // main's validators bound every flag; these hold for any caller.
  if (config.tokens < 1 || config.vocab < 1) {
    return {Code::kInvalidArgument, "--tokens, --vocab: expected values >= 1, got " + std::to_string(config.tokens) +
                                        " and " + std::to_string(config.vocab)};
  }
  if (!std::isfinite(config.stddev) || config.stddev <= 0.0f) {
    return {Code::kInvalidArgument, "--std: expected a finite number > 0, got " + std::to_string(config.stddev)};
  }
  int64_t count = 0;
  int64_t bytes = 0;  // float32 logits, their float16 copy, int64 targets
  if (__builtin_mul_overflow(config.tokens, config.vocab, &count) || __builtin_mul_overflow(count, 6, &bytes) ||
      __builtin_add_overflow(bytes, 8 * config.tokens, &bytes)) {
    return {Code::kInvalidArgument, "--tokens x --vocab: expected a product that fits in 64 bits, got " +
                                        std::to_string(config.tokens) + " x " + std::to_string(config.vocab)};
  }
  const std::string request = std::to_string(config.tokens) + " x " + std::to_string(config.vocab);
  if (Status s = check_fits_in_memory("--tokens x --vocab", static_cast<double>(bytes), request); !s.ok()) return s;
  return catch_out_of_memory("gen: --tokens " + std::to_string(config.tokens) + " x --vocab " +
                                 std::to_string(config.vocab) + " (about " + std::to_string(bytes >> 20) + " MiB)",
                             [&] { return generate(config, static_cast<std::size_t>(count)); });
}

}  // namespace vpce::tools
