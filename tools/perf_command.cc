// tools/perf_command.cc: `vpce perf`, a benchmark in the style of nccl-tests: sweeps tokens
// (-b, -e, -f), vocabularies (-V), ranks (-t) and dtypes (-d); times the forward and the
// backward on R in-process ranks, out of place and in place; prints each row's effective
// bandwidth and its percentage of the machine's bound, and #wrong against the fp64 oracle.
//
// The bound of a row is the larger of two times measured in the same run: its bytes (logits
// read by the forward and by the backward, gradient written) over the bandwidth of a
// parallel copy of a buffer larger than the caches, and its exponentials (one per logit in
// the forward and one in the backward) over the throughput of the vectorised exp on data
// in cache, on all threads. Both are sampled after every timed iteration, and %bound is the
// median of the iterations' ratios: the machine is compared with itself at the same moment.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "checks.h"
#include "commands.h"
#include "cpu/dtype.h"
#include "cpu/simd_rows.h"
#include "rank_threads.h"
#include "reference/reference.h"
#include "validate.h"
#include "vpce/vpce.h"

namespace vpce::tools {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

struct MachineBound {
  double copy_bytes_per_second = 0.0;
  double exps_per_second = 0.0;
};

// Reads every cache line of data once.
void read_through(const std::byte* data, std::size_t bytes) {
  uint64_t sum = 0;
  for (std::size_t i = 0; i < bytes; i += 64) sum += static_cast<uint64_t>(data[i]);
  if (sum == 0x5eed) std::printf(" ");  // keeps the reads observable
}

// Samples the machine's bound: a parallel copy of a 512 MiB buffer into another (1 GiB of
// traffic, larger than the caches; best of two), and the vectorised exp of 4000 floats in
// [-16, 0) into 4000 others, in L1, on every thread (best of three). Sampled between the
// timed iterations, so that each iteration is compared with the machine as it was then:
// a shared machine's speed drifts.
class BoundMeter {
 public:
  explicit BoundMeter(int threads) : threads_(threads), src_(new char[kBytes]), dst_(new char[kBytes]) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t chunk = 0; chunk < kChunks; ++chunk) {
      std::memset(src_.get() + chunk * (kBytes / kChunks), static_cast<int>(chunk), kBytes / kChunks);
      std::memset(dst_.get() + chunk * (kBytes / kChunks), 0, kBytes / kChunks);
    }
  }

  MachineBound sample() const { return {copy_bandwidth(false), exp_throughput()}; }

  // The same copy with non-temporal stores (no read of each destination line before it is
  // written): not the bound, printed so that readers see how much tighter a bound it is.
  double streaming_copy_bandwidth() const { return copy_bandwidth(true); }

 private:
  static constexpr std::size_t kBytes = std::size_t{512} << 20;
  static constexpr int64_t kChunks = 512;

  // Best of two: the first may also pay for writing back what the timed iteration left in
  // cache. memcpy of 1 MiB pieces uses ordinary stores (below glibc's non-temporal threshold).
  double copy_bandwidth(bool non_temporal) const {
    double best = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
      const auto start = Clock::now();
#pragma omp parallel for num_threads(threads_) schedule(static)
      for (int64_t chunk = 0; chunk < kChunks; ++chunk) {
        char* to = dst_.get() + chunk * (kBytes / kChunks);
        const char* from = src_.get() + chunk * (kBytes / kChunks);
        if (non_temporal) {
          detail::stream_copy(to, from, static_cast<int64_t>(kBytes / kChunks));
        } else {
          std::memcpy(to, from, kBytes / kChunks);
        }
      }
      best = std::min(best, seconds_since(start));
    }
    return 2.0 * static_cast<double>(kBytes) / best;
  }

  double exp_throughput() const {
    constexpr int64_t kCount = 4000;  // x and y 16064 bytes apart: no 4 KiB aliasing between loads and stores
    constexpr int kReps = 1000;
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const auto start = Clock::now();
#pragma omp parallel num_threads(threads_)
      {
        // Arguments as the kernels see them (z - max, z - lse): spread over [-16, 0).
        std::vector<float> buffer(2 * kCount + 16);
        float* x = buffer.data();
        float* y = buffer.data() + kCount + 16;
        for (int64_t i = 0; i < kCount; ++i) x[i] = -16.0f * static_cast<float>((i * 97) % kCount) / kCount;
        for (int r = 0; r < kReps; ++r) detail::exp_shifted_lanes(x, 0.0f, y, kCount);
        if (y[0] == 42.0f) std::printf(" ");  // keeps the work observable
      }
      best = std::min(best, seconds_since(start));
    }
    return static_cast<double>(threads_) * kCount * kReps / best;
  }

  int threads_;
  std::unique_ptr<char[]> src_, dst_;
};

struct Row {
  int64_t tokens;
  int64_t vocab;
  DataType dtype;
};

struct Timing {
  static Timing failed(Status why) {
    Timing t;
    t.status = std::move(why);
    return t;
  }
  double forward_ms = 0.0, backward_ms = 0.0;
  double percent_of_bound = 0.0;        // median over the iterations of bound time / time
  int exp_limited = 0, iterations = 0;  // iterations whose bound the exponentials set
  MachineBound bound;                   // medians of the samples
  int64_t wrong = 0;
  Status status;
};

// The median: robust to the spikes other tenants of a shared machine cause.
double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The term that set a row's bound in most of its iterations ("exp" or "bytes"), with a '*'
// when some iterations had the other.
std::string limit_label(const Timing& t) {
  const bool exp = 2 * t.exp_limited > t.iterations;
  const bool mixed = t.exp_limited != 0 && t.exp_limited != t.iterations;
  return std::string(exp ? "exp" : "bytes") + (mixed ? "*" : "");
}

std::string dtype_label(DataType d) { return d == kFloat32 ? "fp32" : d == kBFloat16 ? "bf16" : "fp16"; }

// Fast, reproducible pseudo-normal logits (sum of uniforms), on `threads` threads (never
// OpenMP's default team: OMP_NUM_THREADS may ask for more threads than can start).
void fill_logits(std::byte* data, DataType dtype, int64_t count, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    uint64_t h = static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ULL;
    float sum = 0.0f;
    for (int k = 0; k < 4; ++k) {
      h ^= h >> 29;
      h *= 0xbf58476d1ce4e5b9ULL;
      h ^= h >> 32;
      sum += static_cast<float>(h & 0xffffff) / 16777216.0f;
    }
    const float x = (sum - 2.0f) * 3.4f;  // mean 0, standard deviation about 2
    detail::narrow(x, data + i * dtype.bytes(), dtype);
  }
}

double element(const std::byte* data, DataType dtype, int64_t i) {
  return detail::widen(data + i * dtype.bytes(), dtype);
}

// Counts the loss and gradient elements of up to 32 sampled tokens outside tolerance.
int64_t count_wrong(const Row& row, const std::byte* pristine, const std::vector<int64_t>& targets,
                    const std::vector<float>& loss, const std::byte* grad, DataType grad_dtype, float label_smoothing) {
  const int64_t samples = std::min<int64_t>(32, row.tokens);
  std::vector<int64_t> picked, picked_targets;
  for (int64_t k = 0; k < samples; ++k) picked.push_back(k * row.tokens / samples);
  std::vector<double> x(static_cast<std::size_t>(samples * row.vocab));
  for (int64_t k = 0; k < samples; ++k) {
    for (int64_t v = 0; v < row.vocab; ++v) {
      x[static_cast<std::size_t>(k * row.vocab + v)] = element(pristine, row.dtype, picked[k] * row.vocab + v);
    }
    picked_targets.push_back(targets[static_cast<std::size_t>(picked[k])]);
  }
  const auto want = reference::cross_entropy(x, samples, row.vocab, picked_targets, label_smoothing, {});
  // A bf16 or fp16 gradient: its rounding (2^-8, 2^-11 of the value) and the relative error of
  // the exp of degree 3 or 4 that it is computed with (below 1.4e-4 and 2e-5, docs/design.md).
  const double roundoff = grad_dtype == kFloat32 ? 0.0 : grad_dtype == kBFloat16 ? 0x1p-8 + 1.4e-4 : 0x1p-11 + 2e-5;
  double loss_scale = 0.0, grad_scale = 0.0;
  for (double l : want.loss) loss_scale = std::max(loss_scale, std::fabs(l));
  for (double g : want.grad) grad_scale = std::max(grad_scale, std::fabs(g));
  int64_t wrong = 0;
  for (int64_t k = 0; k < samples; ++k) {
    const double got_loss = loss[static_cast<std::size_t>(picked[k])];
    if (!(std::fabs(got_loss - want.loss[static_cast<std::size_t>(k)]) <= 1e-6 * loss_scale)) ++wrong;
    for (int64_t v = 0; v < row.vocab; ++v) {
      const double w = want.grad[static_cast<std::size_t>(k * row.vocab + v)];
      const double got = element(grad, grad_dtype, picked[k] * row.vocab + v);
      if (!(std::fabs(got - w) <= 1e-6 * grad_scale + roundoff * std::fabs(w))) ++wrong;
    }
  }
  return wrong;
}

// Times one row, out of place (fp32 gradient) or in place.
Timing time_row(const Row& row, const PerfConfig& config, bool in_place, const BoundMeter& meter, std::byte* logits,
                const std::byte* pristine, std::byte* grad_buffer, const std::vector<int64_t>& targets,
                const std::vector<float>& ones) {
  const int ranks = config.ranks;
  std::vector<VocabShard> shards;
  for (int r = 0; r < ranks; ++r) {
    const int64_t begin = row.vocab * r / ranks, end = row.vocab * (r + 1) / ranks;
    shards.push_back({begin, end, row.vocab});
  }
  const int hardware = std::max(1u, std::thread::hardware_concurrency());
  LossOptions options;
  options.label_smoothing = config.label_smoothing;
  options.num_threads = config.threads > 0 ? config.threads : std::max(1, hardware / ranks);
  const DataType grad_dtype = in_place ? row.dtype : kFloat32;
  const std::size_t logits_bytes = static_cast<std::size_t>(row.tokens * row.vocab * row.dtype.bytes());
  std::vector<std::vector<float>> loss(static_cast<std::size_t>(ranks),
                                       std::vector<float>(static_cast<std::size_t>(row.tokens)));
  std::vector<std::vector<double>> lse(static_cast<std::size_t>(ranks),
                                       std::vector<double>(static_cast<std::size_t>(row.tokens)));
  std::unique_ptr<ThreadGroup> group;
  Timing timing;
  if (Status s = ThreadGroup::create(ranks, &group); !s.ok()) return Timing::failed(s);
  std::vector<double> forward_seconds, backward_seconds, percents, copy_samples, exp_samples;
  const double elements = static_cast<double>(row.tokens * row.vocab);
  const double bytes = elements * (2.0 * row.dtype.bytes() + (in_place ? row.dtype.bytes() : 4.0));
  std::vector<Status> results;
  const Status started = run_on_threads(
      *group,
      [&](Communicator& comm) -> Status {
        const auto r = static_cast<std::size_t>(comm.rank());
        const VocabShard& shard = shards[r];
        const int64_t cols = shard.vocab_end - shard.vocab_begin;
        const TensorView x =
            TensorView::matrix(logits + shard.vocab_begin * row.dtype.bytes(), row.dtype, row.tokens, cols, row.vocab);
        const TensorView y = TensorView::contiguous(targets.data(), kInt64, {row.tokens});
        const TensorView l = TensorView::contiguous(loss[r].data(), kFloat32, {row.tokens});
        const TensorView e = TensorView::contiguous(lse[r].data(), kFloat64, {row.tokens});
        const TensorView g = TensorView::contiguous(ones.data(), kFloat32, {row.tokens});
        const TensorView grad =
            in_place ? x
                     : TensorView::matrix(grad_buffer + shard.vocab_begin * 4, kFloat32, row.tokens, cols, row.vocab);
        Workspace workspace;
        char token = 0;
        std::vector<char> gathered(static_cast<std::size_t>(ranks));
        auto barrier = [&] { return comm.all_gather(&token, gathered.data(), 1); };
        for (int iteration = 0; iteration < config.warmup + config.iterations; ++iteration) {
          if (in_place) {
            if (Status s = barrier(); !s.ok()) return s;
            // Non-temporal stores, then one read: the logits start clean, in memory or in the
            // last-level cache as far as it holds them, as in the out-of-place column after its
            // backward's read; not as 100s of MiB of dirty lines whose write-back the timed
            // forward would pay for.
            if (r == 0) {
              detail::stream_copy(logits, pristine, static_cast<int64_t>(logits_bytes));
              read_through(logits, logits_bytes);
            }
          }
          if (Status s = barrier(); !s.ok()) return s;
          const auto start = Clock::now();
          if (Status s = forward(comm, x, y, shard, options, l, e, {}, &workspace); !s.ok()) return s;
          if (Status s = barrier(); !s.ok()) return s;
          const auto middle = Clock::now();
          if (Status s = backward(x, y, e, g, shard, options, grad); !s.ok()) return s;
          if (Status s = barrier(); !s.ok()) return s;
          if (r == 0 && iteration >= config.warmup) {
            const double forward_s = std::chrono::duration<double>(middle - start).count();
            const double backward_s = seconds_since(middle);
            forward_seconds.push_back(forward_s);
            backward_seconds.push_back(backward_s);
            const MachineBound now = meter.sample();  // the other ranks wait, idle, at the barrier below
            copy_samples.push_back(now.copy_bytes_per_second);
            exp_samples.push_back(now.exps_per_second);
            const double bytes_seconds = bytes / now.copy_bytes_per_second;
            const double exp_seconds = 2.0 * elements / now.exps_per_second;
            percents.push_back(100.0 * std::max(bytes_seconds, exp_seconds) / (forward_s + backward_s));
            timing.exp_limited += exp_seconds > bytes_seconds ? 1 : 0;
            ++timing.iterations;
          }
          if (Status s = barrier(); !s.ok()) return s;
        }
        return {};
      },
      "-t", &results);
  if (!started.ok()) return Timing::failed(started);
  for (const Status& s : results) {
    if (!s.ok()) return Timing::failed({Code::kInternalError, s.to_string()});
  }
  timing.forward_ms = 1e3 * median(forward_seconds);
  timing.backward_ms = 1e3 * median(backward_seconds);
  timing.percent_of_bound = median(percents);
  timing.bound = {median(copy_samples), median(exp_samples)};
  if (config.check) {
    timing.wrong = count_wrong(row, pristine, targets, loss[0], in_place ? logits : grad_buffer, grad_dtype,
                               config.label_smoothing);
  }
  return timing;
}

// Every option checked before anything is allocated or timed: the library's own checks of
// the loss options for each -V, and the largest row against this machine's memory.
}  // namespace

Status check_perf_config(const PerfConfig& config) {
  if (config.min_tokens < 1 || config.max_tokens < config.min_tokens || !(config.factor > 1.0) ||
      !std::isfinite(config.factor)) {
    return {Code::kInvalidArgument, "-b, -e, -f: expected 1 <= b <= e and a finite f > 1, got b " +
                                        std::to_string(config.min_tokens) + ", e " + std::to_string(config.max_tokens) +
                                        ", f " + std::to_string(config.factor)};
  }
  if (config.iterations < 1 || config.warmup < 0) {
    return {Code::kInvalidArgument, "-n, -w: expected n >= 1 and w >= 0"};
  }
  if (config.ranks < 1 || config.ranks > kMaxRanks) {
    return {Code::kInvalidArgument,
            "-t: expected 1 to " + std::to_string(kMaxRanks) + " ranks, got " + std::to_string(config.ranks)};
  }
  if (Status s = check_threads("--threads", config.threads); !s.ok()) return s;
  if (const std::string error = detail::simd_target_error(config.simd_target); !error.empty()) {
    return {Code::kInvalidArgument, "--simd-target: " + error};
  }
  for (int64_t vocab : config.vocab) {
    if (vocab < config.ranks) {  // (a rank without columns measures nothing: a row of 0 GB/s)
      return {Code::kInvalidArgument, "-V: expected at least one column per rank (-t " + std::to_string(config.ranks) +
                                          "), got " + std::to_string(vocab)};
    }
    LossOptions options;
    options.label_smoothing = config.label_smoothing;
    if (Status s = detail::check_options(options, VocabShard{0, vocab, vocab}); !s.ok()) {
      return {s.code(), "--label-smoothing: " + s.message()};
    }
    // Logits, their pristine copy and an fp32 gradient, at 4 bytes per element at most.
    const double bytes = 12.0 * static_cast<double>(config.max_tokens) * static_cast<double>(vocab);
    if (Status s = check_fits_in_memory("-e, -V", bytes,
                                        std::to_string(config.max_tokens) + " tokens x V " + std::to_string(vocab));
        !s.ok()) {
      return s;
    }
  }
  return {};
}

namespace {

Status sweep(const PerfConfig& config) {
  const std::string bf16_line = apply_cpu_options(config);
  std::vector<DataType> dtypes;
  if (config.dtype == "fp32" || config.dtype == "all") dtypes.push_back(kFloat32);
  if (config.dtype == "bf16" || config.dtype == "all") dtypes.push_back(kBFloat16);
  if (config.dtype == "fp16" || config.dtype == "all") dtypes.push_back(kFloat16);
  const int hardware = std::max(1u, std::thread::hardware_concurrency());
  const BoundMeter meter(hardware);
  meter.sample();  // the first exp sample also starts the threads and takes the pages' faults
  const MachineBound first_bound = meter.sample();
  std::printf("# vpce perf: R %d, threads per rank %d, SIMD %s, %d hardware threads, label smoothing %g\n",
              config.ranks, config.threads > 0 ? config.threads : std::max(1, hardware / config.ranks),
              detail::simd_target_name(), hardware, static_cast<double>(config.label_smoothing));
  std::printf("# cpu: %s; Highway target %s\n", cpu_model_name().c_str(), detail::simd_target_name());
  std::printf("# %s\n", bf16_line.c_str());
  std::printf(
      "# bound: copy %.2f GB/s (best of 2 copies of 512 MiB, %d threads), exp %.3f Gexp/s (best of 3, in cache, "
      "%d threads) now; sampled again after every timed iteration\n",
      first_bound.copy_bytes_per_second / 1e9, hardware, first_bound.exps_per_second / 1e9, hardware);
  std::printf(
      "# the copy uses ordinary stores, which read each destination line before writing it (as memcpy does "
      "below its non-temporal threshold); with non-temporal stores it moves %.2f GB/s, so rows that write that "
      "way or in place can pass 100 %%\n",
      meter.streaming_copy_bandwidth() / 1e9);
  std::printf(
      "# %%bound: median over the iterations of (the bound's time from the sample after the iteration) / "
      "(the iteration's time); [bound]: the samples' medians\n");
  std::printf(
      "# limit: the bound's term that was larger in most iterations: bytes (over the copy) or exp (two "
      "exponentials per logit over the exp's throughput); '*' when some iterations had the other\n");
  std::printf("# times: median of %d iterations after %d warm-up; check %s\n", config.iterations, config.warmup,
              config.check ? "on (32 sampled tokens vs the fp64 oracle)" : "off");
  std::printf("#%62s%s\n", "", "out-of-place (fp32 gradient)                              in-place");
  std::printf("# %8s %8s %8s %5s  %8s %8s %7s %6s %6s %6s  %8s %8s %7s %6s %6s %6s\n", "tokens", "V", "V/rank", "dtype",
              "fwd(ms)", "bwd(ms)", "GB/s", "%bound", "limit", "#wrong", "fwd(ms)", "bwd(ms)", "GB/s", "%bound",
              "limit", "#wrong");
  double bound_sum = 0.0;
  int bound_count = 0;
  int64_t wrong_total = 0;
  for (int64_t vocab : config.vocab) {
    for (DataType dtype : dtypes) {
      for (double t = static_cast<double>(config.min_tokens); t <= static_cast<double>(config.max_tokens) * 1.0000001;
           t *= config.factor) {
        const Row row{static_cast<int64_t>(t), vocab, dtype};
        const auto count = static_cast<std::size_t>(row.tokens * row.vocab);
        std::unique_ptr<std::byte[]> logits(new std::byte[count * static_cast<std::size_t>(dtype.bytes())]);
        std::unique_ptr<std::byte[]> pristine(new std::byte[count * static_cast<std::size_t>(dtype.bytes())]);
        std::unique_ptr<std::byte[]> grad(new std::byte[count * 4]);
        fill_logits(pristine.get(), dtype, static_cast<int64_t>(count), hardware);
        std::memcpy(logits.get(), pristine.get(), count * static_cast<std::size_t>(dtype.bytes()));
        std::memset(grad.get(), 0, count * 4);  // touch the pages before timing
        std::vector<int64_t> targets(static_cast<std::size_t>(row.tokens));
        for (int64_t i = 0; i < row.tokens; ++i) targets[static_cast<std::size_t>(i)] = (i * 7919) % vocab;
        const std::vector<float> ones(static_cast<std::size_t>(row.tokens), 1.0f);
        std::printf("  %8lld %8lld %8lld %5s", static_cast<long long>(row.tokens), static_cast<long long>(vocab),
                    static_cast<long long>(vocab / config.ranks), dtype_label(dtype).c_str());
        MachineBound shown;
        for (bool in_place : {false, true}) {
          const Timing timing =
              time_row(row, config, in_place, meter, logits.get(), pristine.get(), grad.get(), targets, ones);
          if (!timing.status.ok()) return timing.status;
          const double bytes = static_cast<double>(count) * (2.0 * dtype.bytes() + (in_place ? dtype.bytes() : 4.0));
          const double seconds = (timing.forward_ms + timing.backward_ms) / 1e3;
          bound_sum += timing.percent_of_bound;
          ++bound_count;
          wrong_total += timing.wrong;
          shown = timing.bound;
          std::printf("  %8.3f %8.3f %7.2f %6.1f %6s %6lld", timing.forward_ms, timing.backward_ms,
                      bytes / seconds / 1e9, timing.percent_of_bound, limit_label(timing).c_str(),
                      static_cast<long long>(timing.wrong));
          std::fflush(stdout);
        }
        std::printf("   [bound: %.1f GB/s, %.2f Gexp/s]\n", shown.copy_bytes_per_second / 1e9,
                    shown.exps_per_second / 1e9);
      }
    }
  }
  std::printf("# average %%bound: %.1f   total #wrong: %lld\n", bound_count ? bound_sum / bound_count : 0.0,
              static_cast<long long>(wrong_total));
  if (wrong_total > 0) return {Code::kInternalError, "perf: " + std::to_string(wrong_total) + " wrong elements"};
  return {};
}

}  // namespace

std::string cpu_model_name() {
  std::ifstream info("/proc/cpuinfo");
  std::string line;
  while (std::getline(info, line)) {
    if (line.rfind("model name", 0) == 0) {
      const std::size_t colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

std::string apply_cpu_options(const PerfConfig& config) {
  detail::use_simd_target(config.simd_target);  // (checked by check_perf_config)
  if (config.no_bf16_instructions) detail::set_bf16_instructions_allowed(false);
  if (std::string(detail::simd_target_name()).rfind("AVX3", 0) != 0)
    return std::string("bf16: software rounding, bf16 widened to fp32 (the ") + detail::simd_target_name() +
           " target has no bf16 instructions)";
  if (!detail::cpu_has_avx512_bf16())
    return "bf16: this CPU has no AVX512-BF16 (software rounding, bf16 widened to fp32)";
  return config.no_bf16_instructions ? "bf16: this CPU's AVX512-BF16 turned off (--no-bf16-instructions): software "
                                       "rounding, bf16 widened to fp32"
                                     : "bf16: AVX512-BF16 (its rounding; the head's bf16 tiles from bf16 dot products)";
}

Status perf_command(const PerfConfig& config) {
  if (Status s = check_perf_config(config); !s.ok()) return s;
  return catch_out_of_memory("perf: rows of up to " + std::to_string(config.max_tokens) + " tokens",
                             [&] { return sweep(config); });
}

}  // namespace vpce::tools
