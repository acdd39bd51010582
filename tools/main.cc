// tools/main.cc: the vpce command-line program: parses the command line (CLI11) and runs
// a subcommand. Every error is one line on stderr and exit status 2.
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <limits>
#include <map>
#include <string>

#include "checks.h"
#include "commands.h"
#include "vpce/version.h"

namespace {

constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kIntMax = std::numeric_limits<int>::max();

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) makes write() fail with EFBIG, reported as an error,
  // instead of killing the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  using vpce::tools::float32_number;
  using vpce::tools::integer_in;
  CLI::App app{"vpce " VPCE_VERSION_STRING ": exact vocab-parallel cross-entropy (loss and gradient) on .npy files",
               "vpce"};
  app.set_version_flag("--version", VPCE_VERSION_STRING);
  app.require_subcommand(1, 1);

  vpce::tools::RunConfig run;
  CLI::App* run_cmd =
      app.add_subcommand("run", "Split the vocabulary over R in-process ranks and compute loss, lse and gradient");
  run_cmd->add_option("--logits", run.logits_path, "[..., V] float32 or float16 .npy, full vocabulary")->required();
  run_cmd->add_option("--targets", run.targets_path, "int32 or int64 .npy with the leading shape")->required();
  CLI::Option* tp = run_cmd->add_option("--tp", run.ranks, "number of ranks R, even split (default 1)")
                        ->check(integer_in(1, vpce::tools::kMaxRanks));
  run_cmd
      ->add_option_function<std::string>(
          "--vocab-splits", [&run](const std::string& text) { run.vocab_splits = vpce::tools::integer_list(text); },
          "shard sizes a,b,... summing to V (uneven split)")
      ->check(vpce::tools::integer_list_in(0, kInt64Max))
      ->excludes(tp);
  run_cmd->add_option("--label-smoothing", run.loss.label_smoothing, "label smoothing in [0, 1) (default 0)")
      ->check(float32_number());
  run_cmd
      ->add_option("--smoothing-semantics", run.loss.smoothing_semantics,
                   "megatron: target 1-a, others a/(V-1); pytorch: (1-a) onehot + a/V (default megatron)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, vpce::SmoothingSemantics>{
          {"megatron", vpce::SmoothingSemantics::kMegatron}, {"pytorch", vpce::SmoothingSemantics::kPyTorch}}));
  run_cmd->add_option("--ignore-index", run.loss.ignore_index, "targets equal to this are ignored (default -100)")
      ->check(integer_in(kInt64Min, kInt64Max));
  run_cmd->add_option("--reduction", run.loss.reduction, "none, sum, or mean over counted tokens (default none)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, vpce::Reduction>{
          {"none", vpce::Reduction::kNone}, {"sum", vpce::Reduction::kSum}, {"mean", vpce::Reduction::kMean}}));
  run_cmd->add_option("--z-loss", run.loss.z_loss_weight, "z-loss weight: adds w * lse^2 per token (default 0)")
      ->check(float32_number());
  run_cmd->add_option("--logit-scale", run.loss.logit_scale, "multiply the logits by this first (default 1)")
      ->check(float32_number());
  run_cmd->add_option("--softcap", run.loss.softcap, "soft-cap: z = c * tanh(z / c) (default 0: off)")
      ->check(float32_number());
  run_cmd
      ->add_option("--valid-vocab-size", run.loss.valid_vocab_size,
                   "real classes; columns from here to V are padding (default 0: all)")
      ->check(integer_in(0, kInt64Max));
  run_cmd->add_option("--weights", run.weights_path, "float32 .npy of per-token loss weights, the targets' shape");
  run_cmd->add_option("--grad-output", run.grad_output_path,
                      "float32 .npy upstream gradient: the targets' shape, or one value with --reduction sum/mean");
  run_cmd->add_flag("--extras", run.extras, "also write target_is_argmax.npy and entropy.npy");
  run_cmd->add_flag("--in-place", run.in_place, "write the gradient into the logits buffer");
  run_cmd->add_option("--dtype", run.dtype, "compute on logits converted to this type (default: the file's)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  run_cmd->add_option("--threads", run.loss.num_threads, "threads per rank (default: cores / R; at most 4 x cores)")
      ->check(integer_in(0, kIntMax));
  run_cmd->add_option("--timeout", run.timeout_s, "seconds a rank waits for the others at a collective (default 300)")
      ->check(integer_in(1, 86400));
  run_cmd->add_option("--out", run.out_dir, "output directory")->required();
  run_cmd
      ->add_option("--backend", run.backend,
                   "threads: R in-process ranks (default); mpi: one rank per process under mpirun -np R")
      ->check(CLI::IsMember({"threads", "mpi"}));

  vpce::tools::GenConfig gen;
  CLI::App* gen_cmd = app.add_subcommand("gen", "Write a random example: logits.npy and targets.npy");
  gen_cmd->add_option("--tokens", gen.tokens, "number of tokens N")->check(integer_in(1, int64_t{1} << 24));
  gen_cmd->add_option("--vocab", gen.vocab, "vocabulary size V")->check(integer_in(1, int64_t{1} << 24));
  gen_cmd->add_option("--seed", gen.seed, "random seed")->check(vpce::tools::unsigned_integer());
  gen_cmd->add_option("--std", gen.stddev, "standard deviation of the logits")->check(vpce::tools::finite_positive());
  gen_cmd->add_option("--dtype", gen.dtype, "float32 or float16")->check(CLI::IsMember({"float32", "float16"}));
  gen_cmd->add_option("--out", gen.out_dir, "output directory")->required();

  vpce::tools::PerfConfig perf;
  CLI::App* perf_cmd = app.add_subcommand(
      "perf", "Benchmark forward and backward (nccl-tests style): time, bandwidth, % of the machine's bound, #wrong");
  perf_cmd->add_option("-b,--min-tokens", perf.min_tokens, "smallest number of tokens (default 1024)")
      ->check(integer_in(1, int64_t{1} << 24));
  perf_cmd->add_option("-e,--max-tokens", perf.max_tokens, "largest number of tokens (default 4096)")
      ->check(integer_in(1, int64_t{1} << 24));
  perf_cmd->add_option("-f,--factor", perf.factor, "multiply the tokens by this between rows (default 2)");
  perf_cmd
      ->add_option_function<std::string>(
          "-V,--vocab", [&perf](const std::string& text) { perf.vocab = vpce::tools::integer_list(text); },
          "global vocabulary sizes, comma-separated (default 32000)")
      ->check(vpce::tools::integer_list_in(1, int64_t{1} << 24));
  perf_cmd->add_option("-t,--ranks", perf.ranks, "in-process ranks R (default 1)")->check(integer_in(1, 256));
  perf_cmd->add_option("-d,--dtype", perf.dtype, "fp32, bf16, fp16 or all (default fp32)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "all"}));
  perf_cmd->add_option("-n,--iters", perf.iterations, "timed iterations per row (default 10)")
      ->check(integer_in(1, 100000));
  perf_cmd->add_option("-w,--warmup", perf.warmup, "warm-up iterations per row (default 2)")
      ->check(integer_in(0, 100000));
  perf_cmd->add_option("-c,--check", perf.check, "1: count wrong elements against the fp64 oracle (default 1)")
      ->check(integer_in(0, 1));
  perf_cmd->add_option("--threads", perf.threads, "threads per rank (default: cores / R; at most 4 x cores)")
      ->check(integer_in(0, kIntMax));
  perf_cmd->add_option("--label-smoothing", perf.label_smoothing, "Megatron label smoothing (default 0)")
      ->check(float32_number());
  perf_cmd->add_flag("--head", perf.head,
                     "the fused head (linear + cross-entropy): time vs the unfused step's three GEMMs, peak memory");
  perf_cmd
      ->add_option_function<std::string>(
          "-H,--hidden", [&perf](const std::string& text) { perf.hidden = vpce::tools::integer_list(text); },
          "--head: hidden sizes H, comma-separated (default 1024)")
      ->check(vpce::tools::integer_list_in(1, int64_t{1} << 16));
  perf_cmd->add_option("--mode", perf.head_mode, "--head: recompute, chunked or both (default both)")
      ->check(CLI::IsMember({"recompute", "chunked", "both"}));
  perf_cmd->add_option("--token-block", perf.token_block, "--head: tokens per tile (default 0: the library's)")
      ->check(integer_in(0, 16384));
  perf_cmd->add_option("--vocab-block", perf.vocab_block, "--head: vocabulary rows per tile (default 0: the library's)")
      ->check(integer_in(0, 16384));
  perf_cmd->add_flag("--no-bf16-instructions", perf.no_bf16_instructions,
                     "run as a CPU without AVX512-BF16: software bf16 rounding, and the head's bf16 operands widened "
                     "to fp32 for its tiles");
  perf_cmd->add_option("--simd-target", perf.simd_target,
                       "run the kernels (and the bound's exp) of this Highway target, e.g. AVX2 on an AVX-512 CPU, "
                       "instead of the CPU's best");
  perf_cmd->add_flag("--bf16-logit-gradients", perf.bf16_logit_gradients,
                     "--head: bf16 rows round the logit gradients to bf16 for the gradients' GEMMs "
                     "(HeadOptions::bf16_logit_gradients)");
  perf_cmd
      ->add_option("--chunk-tokens", perf.chunk_tokens,
                   "--head: chunked mode's tokens per chunk (default 0: the library's)")
      ->check(integer_in(0, int64_t{1} << 30));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "vpce: error: %s (see vpce --help)\n", e.what());
    return 2;
  }

  run.ranks_given = tp->count() > 0;
  vpce::Status status;
  bool reports = true;
  // Each command catches its own allocation failures with what it was doing; this is the
  // last resort, so that nothing escapes main as an abort.
  try {
    if (run_cmd->parsed() && run.backend == "mpi") {
#ifdef VPCE_CLI_HAVE_MPI
      status = vpce::tools::run_mpi_command(run, &reports);
#else
      status = {
          vpce::Code::kUnsupported,
          "--backend: expected threads (this vpce was built without MPI; configure with -DVPCE_WITH_MPI=ON), got mpi"};
#endif
    } else if (run_cmd->parsed()) {
      status = vpce::tools::run_command(run);
    } else if (perf_cmd->parsed()) {
#if VPCE_WITH_HEAD
      status = perf.head ? vpce::tools::perf_head_command(perf) : vpce::tools::perf_command(perf);
#else
      status = perf.head ? vpce::Status{vpce::Code::kUnsupported,
                                        "--head: this build of vpce has no fused head "
                                        "(built with VPCE_WITH_HEAD=OFF)"}
                         : vpce::tools::perf_command(perf);
#endif
    } else {
      status = vpce::tools::gen_command(gen);
    }
  } catch (const std::bad_alloc&) {
    status = {vpce::Code::kSystemError, "out of memory (an allocation failed)"};
  } catch (const std::exception& e) {
    status = {vpce::Code::kInternalError, std::string("unexpected exception: ") + e.what()};
  }
  if (!status.ok()) {
    if (!reports) return 2;
    std::fprintf(stderr, "vpce: error: %s\n", status.to_string().c_str());
    return 2;
  }
  return 0;
}
