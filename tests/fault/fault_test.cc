// tests/fault/fault_test.cc: the vpce program under injected faults (vpce_fault_exec): a
// full disk (RLIMIT_FSIZE: write() fails with EFBIG), too little memory (RLIMIT_AS), rank
// threads that cannot be started. Each must end in one error line and exit status 2, with
// nothing half-written: the outputs are all written or none, and an earlier run's files
// stay as they were.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "vpce/version.h"

namespace vpce::test {
namespace {

namespace fs = std::filesystem;

struct Result {
  int status;
  std::string err;  // through a pipe: a file-size limit does not apply to it
  double seconds;
};

// vpce ARGS under the limits LIMITS (vpce_fault_exec options), with the environment
// variables ENV ("NAME=value ..."); stdout is discarded.
Result run_vpce(const std::string& limits, const std::string& args, const std::string& env = "") {
  const std::string command = env + " " + VPCE_FAULT_EXEC_PATH + " " + limits + " --alarm 120 -- " + VPCE_CLI_PATH +
                              " " + args + " 2>&1 >/dev/null";
  const auto start = std::chrono::steady_clock::now();
  std::FILE* pipe = popen(command.c_str(), "r");
  std::string err;
  char buffer[4096];
  for (std::size_t n; pipe != nullptr && (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) err.append(buffer, n);
  const int raw = pipe != nullptr ? pclose(pipe) : -1;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, err, seconds};
}

// The address space the vpce program's shared libraries take (in CUDA builds cuBLAS alone
// is hundreds of MiB), from the dynamic loader's list of them (LD_TRACE_LOADED_OBJECTS, as
// ldd) and their sizes, so that an RLIMIT_AS can be set as that plus what the test allows.
std::string address_space_plus(int64_t bytes) {
  const std::string command = std::string("LD_TRACE_LOADED_OBJECTS=1 ") + VPCE_CLI_PATH;
  std::FILE* pipe = popen(command.c_str(), "r");
  int64_t libraries = 0;
  char line[4096];
  while (pipe != nullptr && std::fgets(line, sizeof(line), pipe) != nullptr) {
    const std::string text(line);
    const std::size_t arrow = text.find("=> /");
    if (arrow == std::string::npos) continue;
    const std::string path = text.substr(arrow + 3, text.find(" (", arrow) - arrow - 3);
    std::error_code error;
    const auto size = fs::file_size(path, error);
    if (!error) libraries += static_cast<int64_t>(size);
  }
  if (pipe != nullptr) pclose(pipe);
  return "--as " + std::to_string(libraries + bytes);
}

void expect_one_error_line(const Result& r, const std::string& fragment) {
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "expected one line: " << r.err;
  EXPECT_EQ(r.err.rfind("vpce: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
}

// Every file in `dir` with its contents.
std::map<std::string, std::string> contents(const fs::path& dir) {
  std::map<std::string, std::string> files;
  if (!fs::exists(dir)) return files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    files[entry.path().filename().string()] = s.str();
  }
  return files;
}

class Fault : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("vpce_fault_test_" + std::to_string(::getpid()) + "_" +
                                        testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    // 12 tokens, V 37: loss.npy is 176 bytes, lse.npy (float64) 224, grad_logits.npy 1904.
    ASSERT_EQ(run_vpce("", "gen --tokens 12 --vocab 37 --out " + (dir_ / "in").string()).status, 0);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string run_args(const fs::path& out) const {
    return "run --logits " + (dir_ / "in" / "logits.npy").string() + " --targets " +
           (dir_ / "in" / "targets.npy").string() + " --extras --out " + out.string();
  }

  fs::path dir_;
};

TEST_F(Fault, FullDiskWritesNoOutputAtAll) {
  // 1000 bytes: loss and lse fit, the gradient (the third output) does not.
  const fs::path out = dir_ / "out";
  expect_one_error_line(run_vpce("--fsize 1000", run_args(out)), "grad_logits.npy: cannot write: File too large");
  EXPECT_TRUE(contents(out).empty()) << "expected no file, not even a temporary";
  // 150 bytes: the first, small output already fails (a buffered stream lost it at close).
  expect_one_error_line(run_vpce("--fsize 150", run_args(out)), "loss.npy: cannot write: File too large");
  EXPECT_TRUE(contents(out).empty());
  // gen too: its targets fit, its logits do not.
  expect_one_error_line(run_vpce("--fsize 1000", "gen --tokens 12 --vocab 37 --out " + (dir_ / "gen").string()),
                        "logits.npy: cannot write: File too large");
  EXPECT_TRUE(contents(dir_ / "gen").empty());
}

TEST_F(Fault, FullDiskLeavesAnEarlierRunsFilesUntouched) {
  const fs::path out = dir_ / "out";
  ASSERT_EQ(run_vpce("", run_args(out)).status, 0);
  const auto before = contents(out);
  ASSERT_EQ(before.size(), 5u);
  for (const char* limit : {"--fsize 150", "--fsize 1000"}) {
    expect_one_error_line(run_vpce(limit, run_args(out) + " --label-smoothing 0.1"), "cannot write: File too large");
    EXPECT_EQ(contents(out), before) << limit << ": the earlier outputs changed, or a temporary was left";
  }
}

// A signal in the middle of writing the outputs (here SIGXFSZ at a file-size limit; Ctrl-C
// and SIGTERM take the same way) ends the program, as it should, but first removes the
// temporaries: none is left behind, and an earlier run's files stay as they were.
TEST_F(Fault, ASignalWhileWritingLeavesNoTemporary) {
  const fs::path out = dir_ / "out";
  ASSERT_EQ(run_vpce("", run_args(out)).status, 0);
  const auto before = contents(out);
  for (const char* limit : {"--fsize-signal 150", "--fsize-signal 1000"}) {
    const Result r = run_vpce(limit, run_args(out) + " --label-smoothing 0.1");
    EXPECT_NE(r.status, 0) << limit << ": " << r.err;  // ended by the signal
    EXPECT_EQ(contents(out), before) << limit << ": the earlier outputs changed, or a temporary was left";
  }
}

#ifndef VPCE_SANITIZED_ADDRESS_SPACE  // a sanitizer's shadow memory needs an unlimited address space
TEST_F(Fault, OutOfMemoryIsAnErrorNotAnAbort) {
  // 64 MiB of logits under 150 MiB of address space beyond the shared libraries: the copies
  // for the run do not fit.
  ASSERT_EQ(run_vpce("", "gen --tokens 2048 --vocab 8192 --out " + (dir_ / "big").string()).status, 0);
  const fs::path out = dir_ / "out";
  expect_one_error_line(
      run_vpce(address_space_plus(157286400), "run --logits " + (dir_ / "big" / "logits.npy").string() + " --targets " +
                                                  (dir_ / "big" / "targets.npy").string() + " --out " + out.string()),
      "logits; about 192.0 MiB in all): out of memory");
  EXPECT_FALSE(fs::exists(out));
  expect_one_error_line(run_vpce(address_space_plus(157286400), "gen --tokens 8192 --vocab 8192 --out " + out.string()),
                        "gen: --tokens 8192 x --vocab 8192 (about 384 MiB): out of memory");
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(Fault, RankThreadsThatCannotStartFailAtOnce) {
  // 1024 rank threads of 8 MiB stacks do not fit in 1 GiB (beyond the shared libraries): the
  // ranks already started must
  // be released, not left waiting for the group's timeout (300 s).
  const Result r = run_vpce(address_space_plus(1073741824), run_args(dir_ / "out") + " --tp 1024");
  expect_one_error_line(r, "--tp: expected 1024 rank threads, could start only ");
  EXPECT_LT(r.seconds, 60.0);
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

// OMP_NUM_THREADS=1024 where 1024 threads cannot start (8 MiB stacks in 2.5 GiB of address
// space beyond the libraries): every command runs on the threads it chose (--threads, or
// the cores), never on OpenMP's default team, whose failure to start ends the program in
// libgomp ("Thread creation failed", exit 1).
TEST_F(Fault, AnOpenMpDefaultOfMoreThreadsThanCanStartIsNeverTaken) {
  const std::string limit = address_space_plus(int64_t{5} << 29);
  std::vector<std::string> commands = {"perf -b 64 -e 64 -V 1000 -n 1 -w 0",
                                       "perf -b 64 -e 64 -V 1000 -n 1 -w 0 --threads 1", run_args(dir_ / "out")};
  if (VPCE_WITH_HEAD) commands.push_back("perf --head -b 64 -e 64 -V 1000 -H 64 -n 1 -w 0");
  for (const std::string& args : commands) {
    const Result r = run_vpce(limit, args, "OMP_NUM_THREADS=1024");
    EXPECT_EQ(r.status, 0) << args << ": " << r.err;
    EXPECT_EQ(r.err, "") << args;
  }
}
#endif

TEST_F(Fault, HugeSizesAreRefusedWithoutAnAbort) {
  // Larger than the machine's memory: refused before any allocation (which would throw, or
  // abort under a sanitizer), not std::bad_alloc escaping (exit 134).
  expect_one_error_line(run_vpce("", "gen --tokens 16777216 --vocab 16777216 --out " + (dir_ / "out").string()),
                        "--tokens x --vocab: expected a size that fits in this machine's");
  expect_one_error_line(run_vpce("", "perf -b 16777216 -e 16777216 -V 16777216"),
                        "-e, -V: expected a size that fits in this machine's");
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

}  // namespace
}  // namespace vpce::test
