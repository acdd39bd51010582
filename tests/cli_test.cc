// tests/cli_test.cc: `vpce run` end to end on .npy files: inputs written byte by byte from
// the format's specification, outputs compared with the fp64 oracle; bad files and values
// give exit status 2, one line on stderr, and no output files.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "npy.h"
#include "reference/reference.h"
#include "vpce/version.h"

namespace vpce::test {
namespace {

namespace fs = std::filesystem;

// A .npy file written without vpce's writer.
void write_npy(const fs::path& path, const std::string& descr, const std::string& shape, const void* data,
               std::size_t bytes) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  header.append(63 - (10 + header.size()) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const char length[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  out.write(length, 2);
  out << header;
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

struct Command {
  int status;
  std::string out, err;
};

Command run_cli(const std::string& args, const fs::path& dir) {
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string command = std::string(VPCE_CLI_PATH) + " " + args + " >" + out.string() + " 2>" + err.string();
  const int raw = std::system(command.c_str());
  auto slurp = [](const fs::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, slurp(out), slurp(err)};
}

class Cli : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("vpce_cli_test_" + std::to_string(::getpid()) + "_" +
                                        testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::mt19937_64 rng(17);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    logits_.resize(kS * kB * kV);
    for (float& x : logits_) x = normal(rng);
    targets_.resize(kS * kB);
    for (std::size_t i = 0; i < targets_.size(); ++i) targets_[i] = static_cast<int32_t>(rng() % kV);
    targets_[0] = 0;
    targets_[1] = kV - 1;
    grad_output_.resize(kS * kB);
    for (float& g : grad_output_) g = 0.25f + static_cast<float>(rng() % 8);
    write_npy(dir_ / "logits.npy", "<f4", "(3, 4, 37)", logits_.data(), logits_.size() * 4);
    write_npy(dir_ / "targets.npy", "<i4", "(3, 4)", targets_.data(), targets_.size() * 4);
    write_npy(dir_ / "grad.npy", "<f4", "(3, 4)", grad_output_.data(), grad_output_.size() * 4);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string inputs() const {
    return "--logits " + (dir_ / "logits.npy").string() + " --targets " + (dir_ / "targets.npy").string();
  }

  void expect_matches_oracle(const fs::path& out, double smoothing, bool with_grad_output, double tolerance) {
    npy::Array loss, lse, grad;
    ASSERT_TRUE(npy::read((out / "loss.npy").string(), &loss).ok());
    ASSERT_TRUE(npy::read((out / "lse.npy").string(), &lse).ok());
    ASSERT_TRUE(npy::read((out / "grad_logits.npy").string(), &grad).ok());
    EXPECT_EQ(loss.shape, (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(lse.shape, (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(grad.shape, (std::vector<int64_t>{3, 4, 37}));
    ASSERT_EQ(grad.dtype, npy::Dtype::kFloat32);
    const std::vector<double> x(logits_.begin(), logits_.end());
    const std::vector<int64_t> y(targets_.begin(), targets_.end());
    const std::vector<double> g =
        with_grad_output ? std::vector<double>(grad_output_.begin(), grad_output_.end()) : std::vector<double>();
    const auto want = reference::cross_entropy(x, kS * kB, kV, y, smoothing, g);
    double grad_scale = 0.0;
    for (double w : want.grad) grad_scale = std::max(grad_scale, std::fabs(w));
    for (std::size_t i = 0; i < want.loss.size(); ++i) {
      EXPECT_NEAR(loss.as<float>()[i], want.loss[i], tolerance * 10);
      EXPECT_NEAR(lse.as<double>()[i], want.lse[i], tolerance * 10);
    }
    for (std::size_t i = 0; i < want.grad.size(); ++i) {
      EXPECT_NEAR(grad.as<float>()[i], want.grad[i], tolerance * grad_scale) << i;
    }
  }

  static constexpr int64_t kS = 3, kB = 4, kV = 37;
  fs::path dir_;
  std::vector<float> logits_;
  std::vector<int32_t> targets_;
  std::vector<float> grad_output_;
};

TEST_F(Cli, RunsEvenSplitAndMatchesOracle) {
  const Command c = run_cli("run " + inputs() + " --tp 4 --out " + (dir_ / "out").string(), dir_);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_NE(c.out.find("tokens 12  V 37  R 4"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("max rank loss difference 0 "), std::string::npos) << c.out;
  expect_matches_oracle(dir_ / "out", 0.0, false, 1e-6);
}

// A run with --extras, then one without into the same --out: the first run's extras would
// pass for the second's, so they are removed, and it says so.
TEST_F(Cli, ARunWithoutExtrasRemovesAnEarlierRunsExtras) {
  const std::string args = "run --logits " + (dir_ / "logits.npy").string() + " --targets " +
                           (dir_ / "targets.npy").string() + " --out " + (dir_ / "out").string();
  ASSERT_EQ(run_cli(args + " --extras", dir_).status, 0);
  ASSERT_TRUE(fs::exists(dir_ / "out" / "entropy.npy"));
  const Command c = run_cli(args, dir_);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_FALSE(fs::exists(dir_ / "out" / "entropy.npy"));
  EXPECT_FALSE(fs::exists(dir_ / "out" / "target_is_argmax.npy"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "loss.npy"));
  EXPECT_NE(c.err.find("removed " + (dir_ / "out" / "entropy.npy").string() + ", an earlier run's"), std::string::npos)
      << c.err;
  // Nothing to remove the next time, nothing said.
  EXPECT_EQ(run_cli(args, dir_).err, "");
}

TEST_F(Cli, UnevenSplitsSmoothingUpstreamGradientInPlaceBf16) {
  const Command c =
      run_cli("run " + inputs() + " --vocab-splits 1,20,0,16 --label-smoothing 0.1 --grad-output " +
                  (dir_ / "grad.npy").string() + " --in-place --dtype fp32 --out " + (dir_ / "out").string(),
              dir_);
  ASSERT_EQ(c.status, 0) << c.err;
  expect_matches_oracle(dir_ / "out", 0.1, true, 1e-6);
  // bf16: the inputs are rounded first, so compare loosely here (exactness in bf16 is
  // covered against the oracle on the same bf16 values in loss_test).
  const Command b =
      run_cli("run " + inputs() + " --tp 3 --dtype bf16 --in-place --out " + (dir_ / "bf16").string(), dir_);
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_NE(b.out.find("dtype bfloat16"), std::string::npos) << b.out;
  expect_matches_oracle(dir_ / "bf16", 0.0, false, 1e-2);
}

TEST_F(Cli, EveryLossOptionMatchesOracle) {
  std::vector<int32_t> targets = targets_;
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = i % 4 == 1 ? -1 : targets[i] % 33;
  std::vector<float> weights(targets.size());
  for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = 0.5f + static_cast<float>(i % 3);
  write_npy(dir_ / "t.npy", "<i4", "(3, 4)", targets.data(), 48);
  write_npy(dir_ / "w.npy", "<f4", "(3, 4)", weights.data(), 48);
  const float upstream = 2.0f;
  write_npy(dir_ / "g.npy", "<f4", "()", &upstream, 4);
  const Command c =
      run_cli("run --logits " + (dir_ / "logits.npy").string() + " --targets " + (dir_ / "t.npy").string() +
                  " --weights " + (dir_ / "w.npy").string() + " --grad-output " + (dir_ / "g.npy").string() +
                  " --vocab-splits 10,10,17 --ignore-index -1 --reduction mean --label-smoothing 0.1"
                  " --smoothing-semantics pytorch --z-loss 0.01 --logit-scale 0.8 --softcap 5"
                  " --valid-vocab-size 33 --extras --out " +
                  (dir_ / "out").string(),
              dir_);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_NE(c.out.find("mean loss"), std::string::npos) << c.out;
  reference::Options o;
  o.label_smoothing = 0.1;
  o.pytorch_smoothing = true;
  o.ignore_index = -1;
  o.z_loss = 0.01;
  o.logit_scale = 0.8;
  o.softcap = 5;
  o.valid_vocab = 33;
  o.reduction = reference::Reduction::kMean;
  const auto want = reference::cross_entropy(std::vector<double>(logits_.begin(), logits_.end()), kS * kB, kV,
                                             std::vector<int64_t>(targets.begin(), targets.end()),
                                             std::vector<double>(weights.begin(), weights.end()), {2.0}, o);
  npy::Array loss, grad, entropy, argmax;
  ASSERT_TRUE(npy::read((dir_ / "out" / "loss.npy").string(), &loss).ok());
  ASSERT_TRUE(npy::read((dir_ / "out" / "grad_logits.npy").string(), &grad).ok());
  ASSERT_TRUE(npy::read((dir_ / "out" / "entropy.npy").string(), &entropy).ok());
  ASSERT_TRUE(npy::read((dir_ / "out" / "target_is_argmax.npy").string(), &argmax).ok());
  EXPECT_TRUE(loss.shape.empty());
  EXPECT_NEAR(loss.as<float>()[0], want.loss[0], 1e-6 * std::fabs(want.loss[0]));
  double scale = 0.0;
  for (double g : want.grad) scale = std::max(scale, std::fabs(g));
  for (std::size_t i = 0; i < want.grad.size(); ++i) EXPECT_NEAR(grad.as<float>()[i], want.grad[i], 1e-6 * scale) << i;
  for (std::size_t i = 0; i < want.entropy.size(); ++i) {
    EXPECT_NEAR(entropy.as<float>()[i], want.entropy[i], 1e-5);
    EXPECT_EQ(argmax.as<float>()[i], want.target_is_argmax[i]);
  }
}

void expect_usage_error(const Command& c, const char* fragment, const fs::path& out) {
  EXPECT_EQ(c.status, 2);
  EXPECT_NE(c.err.find(fragment), std::string::npos) << c.err;
  EXPECT_EQ(std::count(c.err.begin(), c.err.end(), '\n'), 1) << "expected one line: " << c.err;
  EXPECT_FALSE(fs::exists(out / "loss.npy"));
  EXPECT_FALSE(fs::exists(out / "grad_logits.npy"));
}

TEST_F(Cli, BadInputsExitWithStatusTwoAndWriteNothing) {
  const fs::path out = dir_ / "out";
  const std::string tail = " --out " + out.string();
  expect_usage_error(run_cli("run --logits " + (dir_ / "missing.npy").string() + " --targets x" + tail, dir_),
                     "missing.npy: cannot open", out);
  expect_usage_error(run_cli("run --logits " + (dir_ / "targets.npy").string() + " --targets " +
                                 (dir_ / "targets.npy").string() + tail,
                             dir_),
                     "dtype: expected float32 or float16", out);
  write_npy(dir_ / "short.npy", "<i4", "(3, 3)", targets_.data(), 36);
  expect_usage_error(
      run_cli("run --logits " + (dir_ / "logits.npy").string() + " --targets " + (dir_ / "short.npy").string() + tail,
              dir_),
      "shape: expected (3, 4)", out);
  std::vector<int32_t> bad = targets_;
  bad[5] = 37;
  write_npy(dir_ / "bad.npy", "<i4", "(3, 4)", bad.data(), 48);
  expect_usage_error(run_cli("run --logits " + (dir_ / "logits.npy").string() + " --targets " +
                                 (dir_ / "bad.npy").string() + " --tp 2" + tail,
                             dir_),
                     "got 37 at token 5", out);
  expect_usage_error(run_cli("run " + inputs() + " --label-smoothing 1.5" + tail, dir_), "label_smoothing", out);
  expect_usage_error(run_cli("run " + inputs() + " --vocab-splits 10,10" + tail, dir_), "summing to V = 37", out);
  expect_usage_error(run_cli("run " + inputs() + " --dtype fp64" + tail, dir_), "--dtype", out);
  expect_usage_error(run_cli("run " + inputs() + " --reduction average" + tail, dir_), "--reduction", out);
  expect_usage_error(run_cli("run " + inputs() + " --softcap -1" + tail, dir_), "options.softcap", out);
  expect_usage_error(run_cli("run " + inputs() + " --valid-vocab-size 99" + tail, dir_), "options.valid_vocab_size",
                     out);
  expect_usage_error(run_cli("run " + inputs() + " --weights " + (dir_ / "targets.npy").string() + tail, dir_),
                     "expected float32 with shape (3, 4)", out);
  std::ofstream(dir_ / "garbage.npy") << "not a numpy file";
  expect_usage_error(run_cli("run --logits " + (dir_ / "garbage.npy").string() + " --targets x" + tail, dir_), "magic",
                     out);
}

TEST_F(Cli, OutOfRangeIntegersNameTheFlagTheRangeAndTheValue) {
  const fs::path out = dir_ / "out";
  const std::string tail = " --out " + out.string();
  expect_usage_error(run_cli("run " + inputs() + " --ignore-index 99999999999999999999" + tail, dir_),
                     "--ignore-index: expected an integer in [-9223372036854775808, 9223372036854775807], got "
                     "99999999999999999999",
                     out);
  expect_usage_error(run_cli("run " + inputs() + " --valid-vocab-size 1.5" + tail, dir_),
                     "--valid-vocab-size: expected an integer in [0, 9223372036854775807], got 1.5", out);
  expect_usage_error(run_cli("run " + inputs() + " --vocab-splits 10,-1,28" + tail, dir_),
                     "--vocab-splits: expected integers in [0, 9223372036854775807] separated by commas, got "
                     "10,-1,28 (field 2: -1)",
                     out);
  // An empty field is refused, not dropped (",10,27" summed to V = 37 and ran on 2 ranks).
  expect_usage_error(run_cli("run " + inputs() + " --vocab-splits ,10,27" + tail, dir_),
                     "got ,10,27 (field 1 is empty)", out);
  expect_usage_error(run_cli("run " + inputs() + " --vocab-splits 10,,27" + tail, dir_),
                     "got 10,,27 (field 2 is empty)", out);
  expect_usage_error(run_cli("run " + inputs() + " --vocab-splits 10,27," + tail, dir_),
                     "got 10,27, (field 3 is empty)", out);
  expect_usage_error(run_cli("gen --seed -1" + tail, dir_), "--seed: expected an integer in [0, 2^64 - 1], got -1",
                     out);
  expect_usage_error(run_cli("gen --tokens 99999999999999999999" + tail, dir_),
                     "--tokens: expected an integer in [1, 16777216], got 99999999999999999999", out);
  expect_usage_error(run_cli("perf -n 0", dir_), "--iters: expected an integer in [1, 100000], got 0", out);
  // Numbers float32 does not hold, named by the flag and as typed (the library's message
  // named options.logit_scale and "inf").
  expect_usage_error(run_cli("run " + inputs() + " --logit-scale 1e39" + tail, dir_),
                     "--logit-scale: expected a finite number that float32 holds, got 1e39", out);
  expect_usage_error(run_cli("run " + inputs() + " --z-loss 1e-50" + tail, dir_),
                     "--z-loss: expected a finite number that float32 holds, got 1e-50", out);
  expect_usage_error(run_cli("perf --label-smoothing 1e39", dir_), "--label-smoothing: expected a finite number", out);
}

TEST_F(Cli, GenRefusesNonsensicalValues) {
  const fs::path out = dir_ / "out";
  for (const char* stddev : {"nan", "inf", "-1", "0", "1e39"}) {
    const Command c = run_cli(std::string("gen --tokens 2 --vocab 3 --std ") + stddev + " --out " + out.string(), dir_);
    expect_usage_error(c, (std::string("--std: expected a finite number > 0, got ") + stddev).c_str(), out);
    EXPECT_FALSE(fs::exists(out / "logits.npy")) << stddev;
  }
}

TEST_F(Cli, ThreadAndRankCountsAreBounded) {
  const fs::path out = dir_ / "out";
  const std::string tail = " --out " + out.string();
  expect_usage_error(run_cli("run " + inputs() + " --threads 100000" + tail, dir_),
                     "--threads: expected threads per rank in [0, ", out);
  expect_usage_error(run_cli("run " + inputs() + " --tp 1025" + tail, dir_),
                     "--tp: expected an integer in [1, 1024], got 1025", out);
  expect_usage_error(run_cli("perf --threads 100000", dir_), "--threads: expected threads per rank in [0, ", out);
}

TEST_F(Cli, PerfChecksItsOptionsBeforeRunning) {
  const Command c = run_cli("perf -b 16 -e 16 -V 1000 --label-smoothing 2", dir_);
  expect_usage_error(c, "--label-smoothing: options.label_smoothing: expected a value in [0, 1), got 2", dir_);
  EXPECT_EQ(c.err.find("internal error"), std::string::npos) << c.err;
  EXPECT_TRUE(c.out.empty()) << "expected no table before the error: " << c.out;
  expect_usage_error(run_cli("perf -b 16 -e 16 -f nan", dir_), "a finite f > 1", dir_);
  // Fewer columns than ranks: a rank with none (its row read V/rank 0 and 0 GB/s).
  expect_usage_error(run_cli("perf -b 2 -e 2 -t 8 -V 7", dir_),
                     "-V: expected at least one column per rank (-t 8), "
                     "got 7",
                     dir_);
}

// --simd-target runs another target's kernels (SCALAR: every CPU has it), says so, and still
// checks every row against the oracle; a target this CPU cannot run is refused by name.
TEST_F(Cli, PerfRunsTheSimdTargetItIsGiven) {
  const Command c = run_cli("perf --simd-target SCALAR -b 16 -e 16 -V 1000 -d all -n 1 -w 0", dir_);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_NE(c.out.find("Highway target SCALAR"), std::string::npos) << c.out;
  int rows = 0;
  std::istringstream lines(c.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_NE(line.find(" 0   [bound"), std::string::npos) << "a row with elements wrong: " << line;
    ++rows;
  }
  EXPECT_EQ(rows, 3) << c.out;
  const Command bad = run_cli("perf --simd-target AVX9 -b 16 -e 16", dir_);
  expect_usage_error(bad, "--simd-target: expected one of ", dir_);
  EXPECT_NE(bad.err.find("SCALAR"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("got AVX9"), std::string::npos) << bad.err;
}

#if VPCE_WITH_HEAD
TEST_F(Cli, PerfHeadPrintsItsTableWithNothingWrong) {
  const Command c = run_cli(
      "perf --head -b 40 -e 80 -H 24 -V 700,333 -t 2 -d all -n 1 -w 0 --token-block 16 "
      "--vocab-block 64 --chunk-tokens 32",
      dir_);
  ASSERT_EQ(c.status, 0) << c.err;
  // 2 token counts x 2 vocabularies x 3 dtypes x 2 modes, each with a #wrong of 0 at the end.
  int rows = 0;
  std::istringstream lines(c.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#' || line.find("tokens") != std::string::npos) continue;
    EXPECT_EQ(line.substr(line.find_last_not_of(' ')), "0") << line;
    ++rows;
  }
  EXPECT_EQ(rows, 24) << c.out;
  expect_usage_error(run_cli("perf --head --mode both2", dir_), "--mode", dir_);
  expect_usage_error(run_cli("perf --head -H 0", dir_),
                     "--hidden: expected integers in [1, 65536] separated by commas, got 0 (field 1: 0)", dir_);
  expect_usage_error(run_cli("perf --head -H 24,", dir_), "got 24, (field 2 is empty)", dir_);
  expect_usage_error(run_cli("perf -V 1000,,2000", dir_),
                     "--vocab: expected integers in [1, 16777216] separated by "
                     "commas, got 1000,,2000 (field 2 is empty)",
                     dir_);
}
#else
TEST_F(Cli, PerfHeadSaysThisBuildHasNoHead) {
  const Command c = run_cli("perf --head -b 40 -e 80 -H 24 -V 700", dir_);
  EXPECT_NE(c.status, 0);
  EXPECT_NE(c.err.find("--head: this build of vpce has no fused head"), std::string::npos) << c.err;
}
#endif

TEST_F(Cli, OverflowingNpyDimensionSaysItOverflows) {
  write_npy(dir_ / "huge.npy", "<f4", "(99999999999999999999, 37)", logits_.data(), 16);
  expect_usage_error(
      run_cli("run --logits " + (dir_ / "huge.npy").string() + " --targets x --out " + (dir_ / "out").string(), dir_),
      "shape: expected dimensions of at most 2^63 - 1, got 99999999999999999999, which overflows", dir_);
}

TEST_F(Cli, HelpListsEveryFlag) {
  const Command c = run_cli("run --help", dir_);
  EXPECT_EQ(c.status, 0);
  for (const char* flag : {"--logits",           "--targets",   "--tp",     "--vocab-splits", "--label-smoothing",
                           "--grad-output",      "--in-place",  "--dtype",  "--out",          "--smoothing-semantics",
                           "--ignore-index",     "--reduction", "--z-loss", "--logit-scale",  "--softcap",
                           "--valid-vocab-size", "--weights",   "--extras", "--threads",      "--timeout"}) {
    EXPECT_NE(c.out.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
}  // namespace vpce::test
