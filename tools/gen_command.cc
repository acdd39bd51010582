// tools/gen_command.cc: `vpce gen`: a random example input for `vpce run`.
#include <filesystem>
#include <random>

#include "commands.h"
#include "cpu/dtype.h"
#include "npy.h"

namespace vpce::tools {

Status gen_command(const GenConfig& config) {
  std::mt19937_64 rng(config.seed);
  std::normal_distribution<float> logit(0.0f, config.stddev);
  std::uniform_int_distribution<int64_t> target(0, config.vocab - 1);
  const auto count = static_cast<std::size_t>(config.tokens * config.vocab);
  std::vector<float> logits(count);
  for (float& x : logits) x = logit(rng);
  std::vector<int64_t> targets(static_cast<std::size_t>(config.tokens));
  for (int64_t& y : targets) y = target(rng);

  std::error_code error;
  std::filesystem::create_directories(config.out_dir, error);
  if (error) return {Code::kSystemError, config.out_dir + ": cannot create the directory: " + error.message()};
  const std::string dir = config.out_dir + "/";
  const std::vector<int64_t> shape{config.tokens, config.vocab};
  Status written;
  if (config.dtype == "float16") {
    std::vector<detail::Float16> half(count);
    for (std::size_t i = 0; i < count; ++i) half[i] = detail::from_float<detail::Float16>(logits[i]);
    written = npy::write(dir + "logits.npy", npy::Dtype::kFloat16, shape, half.data());
  } else {
    written = npy::write(dir + "logits.npy", npy::Dtype::kFloat32, shape, logits.data());
  }
  if (!written.ok()) return written;
  return npy::write(dir + "targets.npy", npy::Dtype::kInt64, {config.tokens}, targets.data());
}

}  // namespace vpce::tools
