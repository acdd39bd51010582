// bench/kernels_bench.cc: Google Benchmark microbenchmarks of vpce's kernels: the SIMD
// exp alone (and Highway's, for comparison), one block's statistics and one block's
// gradient (in cache; bf16 also with AVX512-BF16's instructions turned off; a separate fp32
// gradient also with ordinary stores, to keep it in cache), and whole-row
// local statistics and gradient over [tokens, V] (from memory). Reported as items (logits)
// per second.
//   build/bench/vpce_kernels_bench [--target=AVX2] [Google Benchmark's flags]
// --target runs the kernels of that Highway target (AVX3, AVX2, SSE4, ...) instead of the
// best this CPU has: an AVX2-only CPU's code measured on an AVX-512 one (its own ports).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"
#include "highway_exp.h"
#include "vpce/vpce.h"

namespace vpce::detail {
namespace {

std::vector<float> random_floats(int64_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

// n Normal(0, 2) logits stored as `type`.
std::vector<std::byte> random_row(StorageType type, int64_t n) {
  const std::vector<float> values = random_floats(n);
  std::vector<std::byte> row(static_cast<size_t>(n) * 4);
  for (int64_t v = 0; v < n; ++v) {
    const float x = values[static_cast<size_t>(v)];
    if (type == StorageType::kFloat32) reinterpret_cast<float*>(row.data())[v] = x;
    if (type == StorageType::kBFloat16) reinterpret_cast<BFloat16*>(row.data())[v] = from_float<BFloat16>(x);
    if (type == StorageType::kFloat16) reinterpret_cast<Float16*>(row.data())[v] = from_float<Float16>(x);
  }
  return row;
}

// exp of n arguments spread over [-16, 0) (as z - max and z - lse are) into n others, placed
// so that loads and stores do not alias modulo 4 KiB (which would stall the loads). Arg 0:
// vpce's exp (the kernels'), 1: Highway's Exp (which the kernels used before).
void BM_Exp(benchmark::State& state) {
  const int64_t n = 4000;
  std::vector<float> buffer(static_cast<size_t>(2 * n + 16));
  float* x = buffer.data();
  float* y = buffer.data() + n + 16;
  for (int64_t i = 0; i < n; ++i) x[i] = -16.0f * static_cast<float>((i * 97) % n) / static_cast<float>(n);
  const bool highway = state.range(0) != 0;
  for (auto _ : state) {
    if (highway) {
      bench::highway_exp_lanes(x, y, n);
    } else {
      exp_shifted_lanes(x, 0.0f, y, n);
    }
    benchmark::DoNotOptimize(y);
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_Exp)->Arg(0)->Arg(1);

// Args: storage (0 fp32, 1 bf16, 2 fp16), and whether the extras (argmax, weighted sum)
// are asked for, which takes the two-pass route.
void BM_BlockStats(benchmark::State& state) {
  const auto type = static_cast<StorageType>(state.range(0));
  const std::vector<std::byte> row = random_row(type, kBlockColumns);
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        block_stats(row.data(), type, kBlockColumns, TransformParams{}, state.range(1) != 0, state.range(1) != 0));
  }
  state.SetItemsProcessed(state.iterations() * kBlockColumns);
}
BENCHMARK(BM_BlockStats)->Args({0, 0})->Args({1, 0})->Args({2, 0})->Args({0, 1});

// Args: input and output storage (0 fp32, 1 bf16, 2 fp16); output == input runs in place.
void BM_BlockGradient(benchmark::State& state) {
  const auto in = static_cast<StorageType>(state.range(0)), out = static_cast<StorageType>(state.range(1));
  std::vector<std::byte> row = random_row(in, kBlockColumns), grad(kBlockColumns * 4 + 4096);
  // A separate gradient 2 KiB away from the row modulo 4 KiB: no false aliasing of loads and stores.
  const auto apart =
      static_cast<size_t>(reinterpret_cast<uintptr_t>(grad.data()) - reinterpret_cast<uintptr_t>(row.data()));
  std::byte* separate = grad.data() + (2048 + 4096 - apart % 4096) % 4096;
  void* target = in == out ? static_cast<void*>(row.data()) : static_cast<void*>(separate);
  const GradientConstants c = make_gradient_constants(1.0, 12.0, 1.0, 0.0);
  for (auto _ : state) {
    block_gradient(row.data(), in, target, out, kBlockColumns, TransformParams{}, c);
    benchmark::DoNotOptimize(target);
  }
  state.SetItemsProcessed(state.iterations() * kBlockColumns);
}
BENCHMARK(BM_BlockGradient)->Args({0, 0})->Args({0, 1})->Args({1, 0})->Args({1, 1})->Args({2, 0})->Args({2, 2});

// fp32 logits soft-capped at 30 (Gemma's cap), the gradient into fp32: the slope's cost,
// against BM_BlockGradient/0/0 (the same without the cap).
void BM_BlockGradientSoftCapped(benchmark::State& state) {
  const std::vector<std::byte> row = random_row(StorageType::kFloat32, kBlockColumns);
  std::vector<float> grad(kBlockColumns);
  TransformParams t;
  t.cap = 30.0f;
  t.inverse_cap = 1.0f / 30.0f;
  const GradientConstants c = make_gradient_constants(1.0, 12.0, 1.0, 0.0);
  for (auto _ : state) {
    block_gradient(row.data(), StorageType::kFloat32, grad.data(), StorageType::kFloat32, kBlockColumns, t, c);
    benchmark::DoNotOptimize(grad.data());
  }
  state.SetItemsProcessed(state.iterations() * kBlockColumns);
}
BENCHMARK(BM_BlockGradientSoftCapped);

// The same with AVX512-BF16's instructions turned off: a bf16 gradient of fp32 logits rounded
// in software, as AVX-512 CPUs without them do, timed on a CPU that has them (elsewhere the
// same code as BM_BlockGradient). (bf16 gradients of bf16 logits are rounded in integers on
// every target.)
void BM_BlockGradientWithoutBf16Instructions(benchmark::State& state) {
  set_bf16_instructions_allowed(false);
  BM_BlockGradient(state);
  set_bf16_instructions_allowed(true);
}
BENCHMARK(BM_BlockGradientWithoutBf16Instructions)->Args({0, 1});

// A bf16 or fp16 row's gradient into a separate fp32 buffer with ordinary stores instead of
// the non-temporal ones the kernels use, so that it stays in cache (L2) and the arithmetic
// limits, as on an exp-bound machine (bench/exp_bound_in_cache.py's out-of-place rows).
void BM_BlockGradientInCache(benchmark::State& state) {
  set_streaming_stores_allowed(false);
  BM_BlockGradient(state);
  set_streaming_stores_allowed(true);
}
BENCHMARK(BM_BlockGradientInCache)->Args({1, 0})->Args({2, 0});

// Whole problems from memory, one thread. Args: tokens, V, dtype (0 fp32, 1 bf16).
DataType data_type(int64_t arg) { return arg == 0 ? kFloat32 : kBFloat16; }
StorageType storage_type(int64_t arg) { return arg == 0 ? StorageType::kFloat32 : StorageType::kBFloat16; }

void BM_LocalStats(benchmark::State& state) {
  const int64_t tokens = state.range(0), vocab = state.range(1);
  const DataType dtype = data_type(state.range(2));
  const std::vector<std::byte> logits = random_row(storage_type(state.range(2)), tokens * vocab);
  std::vector<int64_t> targets(static_cast<size_t>(tokens), 0);
  std::vector<float> stats(static_cast<size_t>(tokens * 4));
  LossOptions options;
  options.num_threads = 1;
  for (auto _ : state) {
    const Status s =
        calculate_local_stats(TensorView::contiguous(logits.data(), dtype, {tokens, vocab}),
                              TensorView::contiguous(targets.data(), kInt64, {tokens}), VocabShard{0, vocab, vocab},
                              options, TensorView::contiguous(stats.data(), kFloat32, {tokens, 4}));
    if (!s.ok()) state.SkipWithError(s.message().c_str());
  }
  state.SetItemsProcessed(state.iterations() * tokens * vocab);
}
BENCHMARK(BM_LocalStats)->Args({1024, 32000, 0})->Args({1024, 32000, 1})->Unit(benchmark::kMillisecond);

// The gradient into a separate fp32 buffer (fp32 logits) or in place (bf16 logits).
void BM_Gradient(benchmark::State& state) {
  const int64_t tokens = state.range(0), vocab = state.range(1);
  const DataType dtype = data_type(state.range(2));
  std::vector<std::byte> logits = random_row(storage_type(state.range(2)), tokens * vocab);
  std::vector<float> separate(dtype == kFloat32 ? static_cast<size_t>(tokens * vocab) : 0);
  std::vector<int64_t> targets(static_cast<size_t>(tokens), 0);
  // A float64 lse (vpce.torch's) that is not an fp32 value: each row takes its factor e^(fl32(lse) - lse).
  std::vector<double> lse(static_cast<size_t>(tokens), 12.345678901234567);
  std::vector<float> ones(static_cast<size_t>(tokens), 1.0f);
  LossOptions options;
  options.num_threads = 1;
  const TensorView x = TensorView::contiguous(logits.data(), dtype, {tokens, vocab});
  const TensorView grad = dtype == kFloat32 ? TensorView::contiguous(separate.data(), kFloat32, {tokens, vocab}) : x;
  for (auto _ : state) {
    const Status s =
        backward(x, TensorView::contiguous(targets.data(), kInt64, {tokens}),
                 TensorView::contiguous(lse.data(), kFloat64, {tokens}),
                 TensorView::contiguous(ones.data(), kFloat32, {tokens}), VocabShard{0, vocab, vocab}, options, grad);
    if (!s.ok()) state.SkipWithError(s.message().c_str());
  }
  state.SetItemsProcessed(state.iterations() * tokens * vocab);
}
BENCHMARK(BM_Gradient)->Args({1024, 32000, 0})->Args({1024, 32000, 1})->Unit(benchmark::kMillisecond);

// Takes --target=NAME out of argv and restricts the kernels' dispatch to that target; false
// (with a message) where this CPU cannot run it or no such target was built.
bool select_target(int* argc, char** argv) {
  const std::string flag = "--target=";
  for (int i = 1; i < *argc; ++i) {
    if (std::strncmp(argv[i], flag.c_str(), flag.size()) != 0) continue;
    if (const std::string error = use_simd_target(argv[i] + flag.size()); !error.empty()) {
      std::fprintf(stderr, "vpce_kernels_bench: --target: %s\n", error.c_str());
      return false;
    }
    std::memmove(argv + i, argv + i + 1, static_cast<size_t>(*argc - i) * sizeof(char*));  // (with argv's null)
    --*argc;
    return true;
  }
  return true;
}

}  // namespace
}  // namespace vpce::detail

int main(int argc, char** argv) {
  if (!vpce::detail::select_target(&argc, argv)) return 2;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
