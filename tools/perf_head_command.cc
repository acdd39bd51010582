// tools/perf_head_command.cc: `vpce perf --head`, the fused head's benchmark: sweeps tokens
// (-b, -e, -f), hidden sizes (-H), vocabularies (-V), ranks (-t), dtypes (-d) and modes;
// times forward plus backward of linear_cross_entropy on R in-process ranks and, in the
// same run, alternating with it, the three GEMMs of the unfused training step of the same
// shapes with the same BLAS on the same threads (logits = h W^T, grad_hidden = dx W,
// grad_weight = dx^T h: oneDNN's sgemm on each rank's [N, V/R, H]). Prints per row: the time,
// the GFLOP/s of the step's useful work (6 N V H), the time as a percentage of the three
// GEMMs' (median of the iterations' ratios; also as process CPU time), the peak memory beyond inputs and gradients per
// rank (the resident-set high-water mark of a first, untimed call, reset before it, so
// oneDNN's own buffers count) as MiB and as a percentage of the logits' N x V/R x 4 bytes, and #wrong.
//
// #wrong: a separate call with the same shapes and mode in which only 16 tokens count
// (token weights 1 there, 0 elsewhere, a summed loss), so that the fp64 oracle of the
// product and the loss stays cheap: its loss, the grad_hidden rows of those tokens, and all
// of grad_weight and grad_bias are compared (an element is wrong when its error exceeds
// 1e-5 of the largest magnitude of its tensor for fp32 operands, 1e-2 for bf16/fp16).
#include <malloc.h>
#include <oneapi/dnnl/dnnl.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checks.h"
#include "commands.h"
#include "cpu/dtype.h"
#include "rank_threads.h"
#include "reference/reference.h"
#include "vpce/head.h"
#include "vpce/vpce.h"

namespace vpce::tools {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The CPU time of every thread of the process, in seconds.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The process's resident set now and its high-water mark since the last reset, in bytes.
int64_t status_field(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == field) {
      int64_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
    in.ignore(1 << 12, '\n');
  }
  return -1;
}
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

struct Shape {
  int64_t tokens, hidden, vocab;
  DataType dtype;
  bool chunked;
};

// One rank's operands and gradients, in the row's dtype (gradients fp32).
struct RankData {
  VocabShard shard;
  std::vector<std::byte> weight, bias;
  std::vector<float> grad_hidden, grad_weight, grad_bias;
  // The unfused step's buffers, fp32: logits [N, Vr], their gradient (the same buffer).
  std::vector<float> hidden32, weight32, logits;
  Workspace workspace;  // kept between the steps, as a training loop keeps it
};

std::vector<std::byte> random_values(int64_t count, DataType dtype, float std, uint64_t seed) {
  std::vector<std::byte> out(static_cast<std::size_t>(count * dtype.bytes()));
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, std);
  for (int64_t i = 0; i < count; ++i) detail::narrow(d(gen), out.data() + i * dtype.bytes(), dtype);
  return out;
}

std::vector<float> widened(const std::vector<std::byte>& v, DataType dtype) {
  std::vector<float> out(v.size() / static_cast<std::size_t>(dtype.bytes()));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = detail::widen(v.data() + i * dtype.bytes(), dtype);
  return out;
}

struct Problem {
  Shape shape;
  std::vector<std::byte> hidden;
  std::vector<int64_t> targets;
  std::vector<float> token_weights;  // the check's: 1 on the counted tokens, 0 elsewhere
  std::vector<int64_t> counted;
  std::vector<RankData> ranks;
};

Problem make_problem(const Shape& s, int ranks) {
  Problem p;
  p.shape = s;
  p.hidden = random_values(s.tokens * s.hidden, s.dtype, 1.0f, 1);
  std::mt19937_64 gen(2);
  std::uniform_int_distribution<int64_t> t(0, s.vocab - 1);
  for (int64_t i = 0; i < s.tokens; ++i) p.targets.push_back(t(gen));
  p.token_weights.assign(static_cast<std::size_t>(s.tokens), 0.0f);
  for (int64_t k = 0; k < 16 && k < s.tokens; ++k) {
    const int64_t i = k * s.tokens / std::min<int64_t>(16, s.tokens);
    p.counted.push_back(i);
    p.token_weights[static_cast<std::size_t>(i)] = 1.0f;
  }
  const float wstd = 2.0f / std::sqrt(static_cast<float>(s.hidden));  // logits of std about 2
  for (int r = 0; r < ranks; ++r) {
    RankData d;
    d.shard = {s.vocab * r / ranks, s.vocab * (r + 1) / ranks, s.vocab};
    const int64_t vr = d.shard.vocab_end - d.shard.vocab_begin;
    d.weight = random_values(vr * s.hidden, s.dtype, wstd, 10 + static_cast<uint64_t>(r));
    d.bias = random_values(vr, s.dtype, 0.5f, 100 + static_cast<uint64_t>(r));
    d.grad_hidden.assign(static_cast<std::size_t>(s.tokens * s.hidden), 0.0f);
    d.grad_weight.assign(static_cast<std::size_t>(vr * s.hidden), 0.0f);
    d.grad_bias.assign(static_cast<std::size_t>(vr), 0.0f);
    p.ranks.push_back(std::move(d));
  }
  return p;
}

void allocate_unfused(Problem& p) {
  const Shape& s = p.shape;
  const std::vector<float> h = widened(p.hidden, s.dtype);
  for (RankData& d : p.ranks) {
    d.hidden32 = h;
    d.weight32 = widened(d.weight, s.dtype);
    d.logits.assign(static_cast<std::size_t>(s.tokens * (d.shard.vocab_end - d.shard.vocab_begin)), 0.0f);
  }
}

// One rank's fused forward and backward (counted: with the check's token weights).
Status fused_step(Communicator& comm, Problem& p, bool counted, int threads, const HeadOptions& head) {
  const Shape& s = p.shape;
  RankData& d = p.ranks[static_cast<std::size_t>(comm.rank())];
  const int64_t vr = d.shard.vocab_end - d.shard.vocab_begin;
  const TensorView hidden = TensorView::contiguous(p.hidden.data(), s.dtype, {s.tokens, s.hidden});
  const TensorView weight = TensorView::contiguous(d.weight.data(), s.dtype, {vr, s.hidden});
  const TensorView bias = TensorView::contiguous(d.bias.data(), s.dtype, {vr});
  const HeadInputs in{hidden, weight, &bias};
  const TensorView targets = TensorView::contiguous(p.targets.data(), kInt64, {s.tokens});
  const TensorView tw = TensorView::contiguous(p.token_weights.data(), kFloat32, {s.tokens});
  LossOptions options;
  options.reduction = counted ? Reduction::kSum : Reduction::kMean;
  options.num_threads = threads;
  std::vector<float> loss(1), grad_loss(1, 1.0f);
  std::vector<double> lse(static_cast<std::size_t>(s.tokens));
  const TensorView loss_v = TensorView::contiguous(loss.data(), kFloat32, {1});
  const TensorView lse_v = TensorView::contiguous(lse.data(), kFloat64, {s.tokens});
  const TensorView gh = TensorView::contiguous(d.grad_hidden.data(), kFloat32, {s.tokens, s.hidden});
  const TensorView gw = TensorView::contiguous(d.grad_weight.data(), kFloat32, {vr, s.hidden});
  const TensorView gb = TensorView::contiguous(d.grad_bias.data(), kFloat32, {vr});
  const HeadGradients grads{{&gh, false}, {&gw, false}, {&gb, false}};
  ForwardExtras extras;
  if (counted) extras.weights = &tw;
  if (s.chunked) {
    return linear_cross_entropy_forward_backward(comm, in, targets, d.shard, options, head, 1.0f, loss_v, lse_v, grads,
                                                 extras, &d.workspace);
  }
  if (Status st =
          linear_cross_entropy_forward(comm, in, targets, d.shard, options, head, loss_v, lse_v, extras, &d.workspace);
      !st.ok()) {
    return st;
  }
  const TensorView gl = TensorView::contiguous(grad_loss.data(), kFloat32, {1});
  return linear_cross_entropy_backward(in, targets, lse_v, gl, d.shard, options, head, grads, extras.weights,
                                       &d.workspace);
}

// One rank's three GEMMs of the unfused step, fp32, on `threads` threads.
void unfused_gemms(RankData& d, const Shape& s, int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#else
  static_cast<void>(threads);
#endif
  const int64_t vr = d.shard.vocab_end - d.shard.vocab_begin, n = s.tokens, h = s.hidden;
  dnnl_sgemm('N', 'T', n, vr, h, 1.0f, d.hidden32.data(), h, d.weight32.data(), h, 0.0f, d.logits.data(), vr);
  dnnl_sgemm('N', 'N', n, h, vr, 1.0f, d.logits.data(), vr, d.weight32.data(), h, 0.0f, d.grad_hidden.data(), h);
  dnnl_sgemm('T', 'N', vr, h, n, 1.0f, d.logits.data(), vr, d.hidden32.data(), h, 0.0f, d.grad_weight.data(), h);
}

// #wrong of the counted call against the fp64 oracle.
int64_t count_wrong(const Problem& p, int threads) {
  const Shape& s = p.shape;
  const int64_t h = s.hidden, v = s.vocab;
  const double tol = s.dtype == kFloat32 ? 1e-5 : 1e-2;
  std::vector<double> weight(static_cast<std::size_t>(v * h)), bias(static_cast<std::size_t>(v));
  for (const RankData& d : p.ranks) {
    const int64_t vr = d.shard.vocab_end - d.shard.vocab_begin;
    for (int64_t i = 0; i < vr * h; ++i) {
      weight[static_cast<std::size_t>(d.shard.vocab_begin * h + i)] =
          detail::widen(d.weight.data() + i * s.dtype.bytes(), s.dtype);
    }
    for (int64_t i = 0; i < vr; ++i)
      bias[static_cast<std::size_t>(d.shard.vocab_begin + i)] =
          detail::widen(d.bias.data() + i * s.dtype.bytes(), s.dtype);
  }
  const int64_t m = static_cast<int64_t>(p.counted.size());
  std::vector<double> hid(static_cast<std::size_t>(m * h)), logits(static_cast<std::size_t>(m * v));
  std::vector<int64_t> targets;
  for (int64_t k = 0; k < m; ++k) {
    const int64_t i = p.counted[static_cast<std::size_t>(k)];
    targets.push_back(p.targets[static_cast<std::size_t>(i)]);
    for (int64_t c = 0; c < h; ++c)
      hid[static_cast<std::size_t>(k * h + c)] =
          detail::widen(p.hidden.data() + (i * h + c) * s.dtype.bytes(), s.dtype);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t x = 0; x < m * v; ++x) {
    const int64_t k = x / v, c = x % v;
    double sum = bias[static_cast<std::size_t>(c)];
    for (int64_t j = 0; j < h; ++j)
      sum += hid[static_cast<std::size_t>(k * h + j)] * weight[static_cast<std::size_t>(c * h + j)];
    logits[static_cast<std::size_t>(x)] = sum;
  }
  reference::Options o;
  o.reduction = reference::Reduction::kSum;
  const reference::Result r = reference::cross_entropy(logits, m, v, targets, {}, {1.0}, o);
  std::vector<double> gh(static_cast<std::size_t>(m * h), 0.0), gw(static_cast<std::size_t>(v * h), 0.0),
      gb(static_cast<std::size_t>(v), 0.0);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < v; ++c) {
    for (int64_t k = 0; k < m; ++k) {
      const double dx = r.grad[static_cast<std::size_t>(k * v + c)];
      gb[static_cast<std::size_t>(c)] += dx;
      for (int64_t j = 0; j < h; ++j)
        gw[static_cast<std::size_t>(c * h + j)] += dx * hid[static_cast<std::size_t>(k * h + j)];
    }
  }
  for (int64_t k = 0; k < m; ++k) {
    for (int64_t c = 0; c < v; ++c) {
      const double dx = r.grad[static_cast<std::size_t>(k * v + c)];
      for (int64_t j = 0; j < h; ++j)
        gh[static_cast<std::size_t>(k * h + j)] += dx * weight[static_cast<std::size_t>(c * h + j)];
    }
  }
  auto wrong = [](const std::vector<double>& got, const std::vector<double>& want, double t) {
    double scale = 0.0;
    for (double w : want) scale = std::max(scale, std::fabs(w));
    int64_t count = 0;
    for (std::size_t i = 0; i < want.size(); ++i) count += !(std::fabs(got[i] - want[i]) <= t * scale);
    return count;
  };
  std::vector<double> got_h(static_cast<std::size_t>(m * h), 0.0), got_w(gw.size()), got_b(gb.size());
  for (const RankData& d : p.ranks) {
    for (int64_t k = 0; k < m; ++k) {
      const int64_t i = p.counted[static_cast<std::size_t>(k)];
      for (int64_t j = 0; j < h; ++j)
        got_h[static_cast<std::size_t>(k * h + j)] +=
            static_cast<double>(d.grad_hidden[static_cast<std::size_t>(i * h + j)]);
    }
    std::copy(d.grad_weight.begin(), d.grad_weight.end(), got_w.begin() + d.shard.vocab_begin * h);
    std::copy(d.grad_bias.begin(), d.grad_bias.end(), got_b.begin() + d.shard.vocab_begin);
  }
  return wrong(got_h, gh, tol) + wrong(got_w, gw, tol) + wrong(got_b, gb, tol);
}

const char* dtype_name(DataType d) { return d == kFloat32 ? "fp32" : d == kBFloat16 ? "bf16" : "fp16"; }

}  // namespace

namespace {

Status sweep_head(const PerfConfig& config);

}  // namespace

Status perf_head_command(const PerfConfig& config) {
  if (Status s = check_perf_config(config); !s.ok()) return s;
  for (const int64_t hidden : config.hidden) {
    for (const int64_t vocab : config.vocab) {
      // The unfused step's logits, the weight (input, fp32 copy, gradient) and the hidden
      // states (input, fp32 copy and gradient per rank), at 4 bytes per element.
      const double n = static_cast<double>(config.max_tokens), v = static_cast<double>(vocab);
      const double h = static_cast<double>(hidden);
      const double bytes = 4.0 * (n * v + 3.0 * v * h + 3.0 * n * h * config.ranks);
      if (Status s = check_fits_in_memory("-e, -V, -H", bytes,
                                          std::to_string(config.max_tokens) + " tokens x V " + std::to_string(vocab) +
                                              " x H " + std::to_string(hidden));
          !s.ok()) {
        return s;
      }
    }
  }
  return catch_out_of_memory("perf --head: rows of up to " + std::to_string(config.max_tokens) + " tokens",
                             [&] { return sweep_head(config); });
}

namespace {

Status sweep_head(const PerfConfig& config) {
  const std::string bf16_line = apply_cpu_options(config);
  const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = config.threads > 0 ? config.threads : std::max(1, hardware / config.ranks);
  std::vector<DataType> dtypes;
  if (config.dtype == "fp32" || config.dtype == "all") dtypes.push_back(kFloat32);
  if (config.dtype == "bf16" || config.dtype == "all") dtypes.push_back(kBFloat16);
  if (config.dtype == "fp16" || config.dtype == "all") dtypes.push_back(kFloat16);
  std::vector<bool> modes;
  if (config.head_mode == "recompute" || config.head_mode == "both") modes.push_back(false);
  if (config.head_mode == "chunked" || config.head_mode == "both") modes.push_back(true);
  HeadOptions head;
  head.token_block = config.token_block;
  head.vocab_block = config.vocab_block;
  head.chunk_tokens = config.chunk_tokens;
  std::unique_ptr<ThreadGroup> group;
  if (Status s = ThreadGroup::create(config.ranks, &group); !s.ok()) return s;
  std::printf("# vpce perf --head: fused linear + cross-entropy, forward + backward; R = %d ranks x %d threads\n",
              config.ranks, threads);
  std::printf("# cpu: %s; %s\n", cpu_model_name().c_str(), bf16_line.c_str());
  std::printf("# vs3gemm: time / time of the unfused step's three GEMMs (oneDNN sgemm, same shapes and threads)\n");
  std::printf("# extra: peak memory per rank beyond inputs and gradients; %%logits: of N x V/R x 4 bytes\n");
  std::printf("# cpu: the same ratio of the process's CPU time (all threads), which a shared machine perturbs less\n");
  if (config.bf16_logit_gradients) {
    std::printf(
        "# -dx16: bf16 rows with HeadOptions::bf16_logit_gradients (dx rounded to bf16 for the gradients' "
        "GEMMs)\n");
  }
  std::printf("%8s %6s %8s %3s %5s %-14s %10s %9s %9s %6s %9s %9s %7s\n", "tokens", "H", "V", "R", "dtype", "mode",
              "time(ms)", "GFLOP/s", "vs3gemm", "cpu", "extra", "%logits", "#wrong");
  for (const int64_t hidden : config.hidden) {
    for (const int64_t vocab : config.vocab) {
      for (int64_t tokens = config.min_tokens; tokens <= config.max_tokens;
           tokens =
               std::max(tokens + 1, static_cast<int64_t>(std::llround(static_cast<double>(tokens) * config.factor)))) {
        for (const DataType dtype : dtypes) {
          for (const bool chunked : modes) {
            const Shape s{tokens, hidden, vocab, dtype, chunked};
            head.bf16_logit_gradients = config.bf16_logit_gradients && dtype == kBFloat16;
            const std::string mode =
                std::string(chunked ? "chunked" : "recompute") + (head.bf16_logit_gradients ? "-dx16" : "");
            Problem p = make_problem(s, config.ranks);
            allocate_unfused(p);
            std::vector<Status> st;
            auto fused = [&](bool counted) {
              return run_on_threads(
                  *group, [&](Communicator& c) { return fused_step(c, p, counted, threads, head); }, "-t", &st);
            };
            auto gemms = [&] {
              return run_on_threads(
                  *group,
                  [&](Communicator& c) {
                    unfused_gemms(p.ranks[static_cast<std::size_t>(c.rank())], s, threads);
                    return Status{};
                  },
                  "-t", &st);
            };
            // The peak: one call during which every buffer of 128 KiB or more is its own
            // mapping, returned to the system when freed, so that the resident set's
            // high-water mark measures what the call holds. The timed calls then run with
            // glibc's usual reuse of freed buffers (a 32 MiB threshold, its largest dynamic
            // one): mapping each GEMM's packing buffer afresh would slow the many tile GEMMs.
            mallopt(M_MMAP_THRESHOLD, 128 * 1024);
            const int64_t before = status_field("VmRSS:");
            reset_peak();
            if (Status e = fused(false); !e.ok()) return e;
            for (const Status& e : st) {
              if (!e.ok()) return e;
            }
            const int64_t extra = status_field("VmHWM:") - before;
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            std::vector<double> times, ratios, cpu_ratios;
            for (int it = 0; it < config.warmup + config.iterations; ++it) {
              auto t0 = Clock::now();
              const double c0 = process_cpu_seconds();
              if (Status e = fused(false); !e.ok()) return e;
              for (const Status& e : st) {
                if (!e.ok()) return e;
              }
              const double t_fused = seconds_since(t0);
              const double c_fused = process_cpu_seconds() - c0;
              t0 = Clock::now();
              const double c1 = process_cpu_seconds();
              if (Status e = gemms(); !e.ok()) return e;
              const double t_gemms = seconds_since(t0);
              const double c_gemms = process_cpu_seconds() - c1;
              if (it >= config.warmup) {
                times.push_back(t_fused);
                ratios.push_back(t_fused / t_gemms);
                cpu_ratios.push_back(c_fused / c_gemms);
              }
            }
            std::sort(times.begin(), times.end());
            std::sort(ratios.begin(), ratios.end());
            std::sort(cpu_ratios.begin(), cpu_ratios.end());
            int64_t wrong = -1;
            if (config.check != 0) {
              if (Status e = fused(true); !e.ok()) return e;
              for (const Status& e : st) {
                if (!e.ok()) return e;
              }
              wrong = count_wrong(p, hardware);
            }
            const double t = times[times.size() / 2];
            const double logits_bytes = static_cast<double>(tokens) * (static_cast<double>(vocab) / config.ranks) * 4.0;
            const double extra_per_rank = static_cast<double>(extra) / config.ranks;
            std::printf("%8lld %6lld %8lld %3d %5s %-14s %10.2f %9.1f %8.0f%% %5.0f%% %7.1fMi %8.2f%% %7s\n",
                        static_cast<long long>(tokens), static_cast<long long>(hidden), static_cast<long long>(vocab),
                        config.ranks, dtype_name(dtype), mode.c_str(), t * 1e3,
                        6.0 * tokens * vocab * hidden / t * 1e-9, ratios[ratios.size() / 2] * 100.0,
                        cpu_ratios[cpu_ratios.size() / 2] * 100.0, extra_per_rank / (1 << 20),
                        extra_per_rank / logits_bytes * 100.0, wrong < 0 ? "-" : std::to_string(wrong).c_str());
            std::fflush(stdout);
            if (wrong > 0) {
              return {Code::kInternalError, "perf --head: " + std::to_string(wrong) + " wrong elements"};
            }
          }
        }
      }
    }
  }
  return {};
}

}  // namespace
}  // namespace vpce::tools
