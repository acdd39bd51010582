// tools/main.cc: the vpce command-line program: parses the command line (CLI11) and runs
// a subcommand. Every error is one line on stderr and exit status 2.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "commands.h"
#include "vpce/version.h"

int main(int argc, char** argv) {
  CLI::App app{"vpce " VPCE_VERSION_STRING
               ": exact vocab-parallel cross-entropy (loss and gradient) on .npy files",
               "vpce"};
  app.set_version_flag("--version", VPCE_VERSION_STRING);
  app.require_subcommand(1, 1);

  vpce::tools::RunConfig run;
  CLI::App* run_cmd = app.add_subcommand(
      "run", "Split the vocabulary over R in-process ranks and compute loss, lse and gradient");
  run_cmd->add_option("--logits", run.logits_path, "[..., V] float32 or float16 .npy, full vocabulary")
      ->required();
  run_cmd->add_option("--targets", run.targets_path, "int32 or int64 .npy with the leading shape")
      ->required();
  CLI::Option* tp = run_cmd->add_option("--tp", run.ranks, "number of ranks R, even split (default 1)")
                        ->check(CLI::Range(1, 4096));
  run_cmd->add_option("--vocab-splits", run.vocab_splits, "shard sizes a,b,... summing to V (uneven split)")
      ->delimiter(',')
      ->excludes(tp);
  run_cmd->add_option("--label-smoothing", run.label_smoothing, "Megatron label smoothing in [0, 1)");
  run_cmd->add_option("--grad-output", run.grad_output_path,
                      "float32 .npy of upstream gradients, the targets' shape (default ones)");
  run_cmd->add_flag("--in-place", run.in_place, "write the gradient into the logits buffer");
  run_cmd->add_option("--dtype", run.dtype, "compute on logits converted to this type (default: the file's)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  run_cmd->add_option("--threads", run.threads_per_rank, "threads per rank (default: cores / R)")
      ->check(CLI::Range(0, 1024));
  run_cmd->add_option("--out", run.out_dir, "output directory")->required();

  vpce::tools::GenConfig gen;
  CLI::App* gen_cmd = app.add_subcommand("gen", "Write a random example: logits.npy and targets.npy");
  gen_cmd->add_option("--tokens", gen.tokens, "number of tokens N")->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  gen_cmd->add_option("--vocab", gen.vocab, "vocabulary size V")->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  gen_cmd->add_option("--seed", gen.seed, "random seed");
  gen_cmd->add_option("--std", gen.stddev, "standard deviation of the logits")->check(CLI::PositiveNumber);
  gen_cmd->add_option("--dtype", gen.dtype, "float32 or float16")->check(CLI::IsMember({"float32", "float16"}));
  gen_cmd->add_option("--out", gen.out_dir, "output directory")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "vpce: error: %s (see vpce --help)\n", e.what());
    return 2;
  }

  vpce::Status status;
  if (run_cmd->parsed()) {
    status = vpce::tools::run_command(run);
  } else {
    status = vpce::tools::gen_command(gen);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "vpce: error: %s\n", status.to_string().c_str());
    return 2;
  }
  return 0;
}
