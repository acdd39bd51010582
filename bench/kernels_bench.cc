// bench/kernels_bench.cc: Google Benchmark microbenchmarks of vpce's kernels: the SIMD
// exp alone, one block's statistics and one block's gradient (in cache), and whole-row
// local statistics and gradient over [tokens, V] (from memory). Reported as items
// (logits) per second.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"
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

void BM_Exp(benchmark::State& state) {
  std::vector<float> data(static_cast<size_t>(state.range(0)), -0.5f);
  for (auto _ : state) {
    exp_in_place(data.data(), state.range(0));
    benchmark::DoNotOptimize(data.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Exp)->Arg(4096);

void BM_BlockStats(benchmark::State& state) {
  const std::vector<float> row = random_floats(kBlockColumns);
  for (auto _ : state) {
    benchmark::DoNotOptimize(block_stats(row.data(), StorageType::kFloat32, kBlockColumns, TransformParams{},
                                         state.range(0) != 0, state.range(0) != 0));
  }
  state.SetItemsProcessed(state.iterations() * kBlockColumns);
}
BENCHMARK(BM_BlockStats)->Arg(0)->Arg(1);

void BM_BlockGradient(benchmark::State& state) {
  const std::vector<float> row = random_floats(kBlockColumns);
  std::vector<float> grad(kBlockColumns);
  const GradientConstants c{1.0f, 12.0f, 1.0f, 0.0f};
  for (auto _ : state) {
    block_gradient(row.data(), StorageType::kFloat32, grad.data(), StorageType::kFloat32, kBlockColumns,
                   TransformParams{}, c);
    benchmark::DoNotOptimize(grad.data());
  }
  state.SetItemsProcessed(state.iterations() * kBlockColumns);
}
BENCHMARK(BM_BlockGradient);

// Whole problems from memory: [tokens, V] fp32, one thread.
void BM_LocalStats(benchmark::State& state) {
  const int64_t tokens = state.range(0), vocab = state.range(1);
  const std::vector<float> logits = random_floats(tokens * vocab);
  std::vector<int64_t> targets(static_cast<size_t>(tokens), 0);
  std::vector<float> stats(static_cast<size_t>(tokens * 4));
  LossOptions options;
  options.num_threads = 1;
  for (auto _ : state) {
    const Status s = calculate_local_stats(TensorView::contiguous(logits.data(), kFloat32, {tokens, vocab}),
                                           TensorView::contiguous(targets.data(), kInt64, {tokens}),
                                           VocabShard{0, vocab, vocab}, options,
                                           TensorView::contiguous(stats.data(), kFloat32, {tokens, 4}));
    if (!s.ok()) state.SkipWithError(s.message().c_str());
  }
  state.SetItemsProcessed(state.iterations() * tokens * vocab);
}
BENCHMARK(BM_LocalStats)->Args({1024, 32000})->Unit(benchmark::kMillisecond);

void BM_Gradient(benchmark::State& state) {
  const int64_t tokens = state.range(0), vocab = state.range(1);
  const std::vector<float> logits = random_floats(tokens * vocab);
  std::vector<float> grad(static_cast<size_t>(tokens * vocab));
  std::vector<int64_t> targets(static_cast<size_t>(tokens), 0);
  std::vector<float> lse(static_cast<size_t>(tokens), 12.0f), ones(static_cast<size_t>(tokens), 1.0f);
  LossOptions options;
  options.num_threads = 1;
  for (auto _ : state) {
    const Status s = backward(TensorView::contiguous(logits.data(), kFloat32, {tokens, vocab}),
                              TensorView::contiguous(targets.data(), kInt64, {tokens}),
                              TensorView::contiguous(lse.data(), kFloat32, {tokens}),
                              TensorView::contiguous(ones.data(), kFloat32, {tokens}), VocabShard{0, vocab, vocab},
                              options, TensorView::contiguous(grad.data(), kFloat32, {tokens, vocab}));
    if (!s.ok()) state.SkipWithError(s.message().c_str());
  }
  state.SetItemsProcessed(state.iterations() * tokens * vocab);
}
BENCHMARK(BM_Gradient)->Args({1024, 32000})->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace vpce::detail

BENCHMARK_MAIN();
