// tools/commands.h: the subcommands of the vpce program, each a function from its parsed
// options to a Status (the caller prints errors and sets the exit status).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "vpce/loss.h"
#include "vpce/status.h"

namespace vpce::tools {

struct RunConfig {
  std::string logits_path;
  std::string targets_path;
  std::string grad_output_path;  // empty: an upstream gradient of ones
  std::string weights_path;      // empty: no per-token weights
  std::string out_dir;
  int ranks = 1;                      // --tp
  bool ranks_given = false;           // whether --tp was on the command line
  std::vector<int64_t> vocab_splits;  // --vocab-splits; empty: even split over `ranks`
  LossOptions loss;                   // every loss option; num_threads from --threads
  bool extras = false;                // also write target_is_argmax.npy and entropy.npy
  bool in_place = false;
  std::string dtype;                // "fp32", "bf16", "fp16", or empty for the file's own
  std::string backend = "threads";  // "threads" (in-process) or "mpi" (one process per rank)
  int timeout_s = 300;              // --timeout: how long a rank waits for the others
};

// Splits the vocabulary, runs the ranks, writes DIR/loss.npy, lse.npy, grad_logits.npy
// (and target_is_argmax.npy, entropy.npy with extras) and prints one summary line.
Status run_command(const RunConfig& config);

// `vpce run --backend mpi`: the same, one rank per MPI process (under mpirun); each rank
// reads only its columns of the logits and rank 0 writes the outputs. Every rank returns
// the same Status, and rank 0 has printed it (*reports is false: main prints nothing).
Status run_mpi_command(const RunConfig& config, bool* reports);

struct GenConfig {
  int64_t tokens = 4096;
  int64_t vocab = 32000;
  uint64_t seed = 1;
  float stddev = 2.0f;
  std::string dtype = "float32";  // "float32" or "float16"
  std::string out_dir;
};

// Writes DIR/logits.npy ([tokens, vocab], normal logits) and DIR/targets.npy (int64).
Status gen_command(const GenConfig& config);

struct PerfConfig {
  int64_t min_tokens = 1024;             // -b
  int64_t max_tokens = 4096;             // -e
  double factor = 2.0;                   // -f
  std::vector<int64_t> vocab = {32000};  // -V (global vocabulary sizes)
  int ranks = 1;                         // -t
  std::string dtype = "fp32";            // -d: fp32, bf16, fp16 or all
  int iterations = 10;                   // -n
  int warmup = 2;                        // -w
  int check = 1;                         // -c
  int threads = 0;                       // --threads per rank (0: cores / R)
  float label_smoothing = 0.0f;
  // --head: the fused head (vpce/head.h) instead of the loss of logits.
  bool head = false;
  std::vector<int64_t> hidden = {1024};                        // -H
  std::string head_mode = "both";                              // --mode: recompute, chunked or both
  int64_t token_block = 0, vocab_block = 0, chunk_tokens = 0;  // HeadOptions (0: defaults)
  // --no-bf16-instructions: run as a CPU without AVX512-BF16 would (the kernels' software bf16
  // rounding; the head's bf16 operands widened to fp32 for its tiles).
  bool no_bf16_instructions = false;
  // --simd-target: the kernels of this Highway target (AVX2 on an AVX-512 CPU) rather than the
  // CPU's best; the bound's exp too.
  std::string simd_target;
  // --bf16-logit-gradients: the head's bf16 rows with HeadOptions::bf16_logit_gradients.
  bool bf16_logit_gradients = false;
};

// Prints the nccl-tests-style table; fails if any checked element is wrong.
Status perf_command(const PerfConfig& config);
// The checks of perf's options that every mode shares (-b, -e, -f, -n, -w, -t, --threads,
// --label-smoothing, and that the logits of a row fit in memory).
Status check_perf_config(const PerfConfig& config);
// `vpce perf --head`: the fused head's table (tools/perf_head_command.cc).
Status perf_head_command(const PerfConfig& config);
// The CPU's model name as /proc/cpuinfo gives it ("unknown CPU" where it does not).
std::string cpu_model_name();
// Applies --simd-target (as check_perf_config found it) and --no-bf16-instructions; returns
// the header line that says how the run rounds bf16 (AVX512-BF16 or in software).
std::string apply_cpu_options(const PerfConfig& config);

}  // namespace vpce::tools
