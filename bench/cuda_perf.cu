// bench/cuda_perf.cu: vpce on one GPU, in the style of nccl-tests: for each row (tokens,
// V per rank, dtype) the forward and the in-place backward of one rank's shard, timed with
// CUDA events (median of -n after -w warm-up), the bytes moved (the logits read twice and
// the gradient written once) over the time, as a fraction of a device-to-device copy
// measured in the same run, and #wrong: sampled tokens whose loss is off the fp64 value
// computed on the host from the same logits.
//
//   vpce_cuda_perf [iterations] [--quick]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_bench.cuh"
#include "vpce/vpce.h"

namespace {

// Logits ~ N(0, 2) from a counter-based hash (Box-Muller), targets uniform.
template <class T>
__global__ void fill(T* logits, int64_t n, int64_t* targets, int64_t tokens, int64_t vocab, uint64_t seed) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t k = i; k < n; k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = 2.0f * vpce_bench::normal_draw(seed, k);
    if constexpr (sizeof(T) == 4) {
      logits[k] = x;
    } else {
      logits[k] = __float2bfloat16_rn(x);
    }
    if (k < tokens)
      targets[k] = static_cast<int64_t>(vpce_bench::mix(seed ^ 0x5555 + static_cast<uint64_t>(k)) % vocab);
  }
}

// GB/s of a device-to-device copy of `bytes`, counting bytes read and written; best of 5.
double copy_bandwidth(std::size_t bytes) {
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  float best = 1e30f;
  for (int it = 0; it < 6; ++it) {
    cudaEventRecord(start);
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (it > 0) best = std::min(best, ms);
  }
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(bytes) / (best * 1e-3) / 1e9;
}

struct Row {
  int64_t tokens, vocab;
  bool bf16;
};

}  // namespace

int main(int argc, char** argv) {
  const auto [iterations, quick] = vpce_bench::parse_arguments(argc, argv);
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double copy_gbs = copy_bandwidth(std::size_t{4} << 30);
  std::printf(
      "# vpce_cuda_perf: %s, %d SMs, %.0f GiB; copy %.0f GB/s (device to device, 4 GiB, read + write, best of 5)\n",
      prop.name, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0, copy_gbs);
  std::printf("# one rank's shard; forward (with its gather) and in-place backward; median of %d after 2 warm-up\n",
              iterations);
  std::printf("#   tokens   V/rank dtype  fwd(ms)  bwd(ms)     GB/s  %%copy #wrong\n");
  std::vector<Row> rows;
  const std::vector<int64_t> token_counts =
      quick ? std::vector<int64_t>{4096, 16384} : std::vector<int64_t>{4096, 16384, 65536};
  const std::vector<int64_t> vocab_sizes = {32000, 128256 / 4, 128256 / 2, 128256, 256000};
  for (bool bf16 : {false, true}) {
    for (int64_t tokens : token_counts) {
      for (int64_t vocab : vocab_sizes) rows.push_back({tokens, vocab, bf16});
    }
  }
  const std::size_t free_limit = static_cast<std::size_t>(0.8 * static_cast<double>(prop.totalGlobalMem));
  int64_t total_wrong = 0;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  for (const Row& row : rows) {
    const std::size_t element = row.bf16 ? 2 : 4;
    const std::size_t bytes = static_cast<std::size_t>(row.tokens * row.vocab) * element;
    if (bytes > free_limit) continue;
    void* logits = nullptr;
    int64_t* targets = nullptr;
    float *loss = nullptr, *upstream = nullptr;
    double* lse = nullptr;
    CHECK_CUDA(cudaMalloc(&logits, bytes));
    CHECK_CUDA(cudaMalloc(&targets, row.tokens * sizeof(int64_t)));
    CHECK_CUDA(cudaMalloc(&loss, row.tokens * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&lse, row.tokens * sizeof(double)));
    CHECK_CUDA(cudaMalloc(&upstream, row.tokens * sizeof(float)));
    std::vector<float> ones(static_cast<std::size_t>(row.tokens), 1.0f);
    CHECK_CUDA(cudaMemcpy(upstream, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
    const int64_t n = row.tokens * row.vocab;
    if (row.bf16) {
      fill<<<4096, 256>>>(static_cast<__nv_bfloat16*>(logits), n, targets, row.tokens, row.vocab, 7);
    } else {
      fill<<<4096, 256>>>(static_cast<float*>(logits), n, targets, row.tokens, row.vocab, 7);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    // Sampled rows, kept on the host before the in-place backward overwrites them.
    const int samples = 8;
    std::vector<std::vector<float>> sampled(samples);
    std::vector<int64_t> sampled_targets(samples);
    for (int s = 0; s < samples; ++s) {
      const int64_t i = (s * 7919) % row.tokens;
      std::vector<unsigned char> raw(static_cast<std::size_t>(row.vocab) * element);
      CHECK_CUDA(cudaMemcpy(raw.data(), static_cast<char*>(logits) + static_cast<std::size_t>(i * row.vocab) * element,
                            raw.size(), cudaMemcpyDeviceToHost));
      sampled[s].resize(static_cast<std::size_t>(row.vocab));
      for (int64_t v = 0; v < row.vocab; ++v) {
        if (row.bf16) {
          uint16_t b;
          std::memcpy(&b, raw.data() + v * 2, 2);
          sampled[s][static_cast<std::size_t>(v)] = vpce_bench::bf16_value(b);
        } else {
          std::memcpy(&sampled[s][static_cast<std::size_t>(v)], raw.data() + v * 4, 4);
        }
      }
      CHECK_CUDA(cudaMemcpy(&sampled_targets[s], targets + i, sizeof(int64_t), cudaMemcpyDeviceToHost));
    }
    const vpce::Device gpu{vpce::DeviceType::kCUDA, 0};
    const vpce::DataType dtype = row.bf16 ? vpce::kBFloat16 : vpce::kFloat32;
    const auto x = vpce::TensorView::contiguous(logits, dtype, {row.tokens, row.vocab}, gpu);
    const auto y = vpce::TensorView::contiguous(targets, vpce::kInt64, {row.tokens}, gpu);
    const auto l = vpce::TensorView::contiguous(loss, vpce::kFloat32, {row.tokens}, gpu);
    const auto e = vpce::TensorView::contiguous(lse, vpce::kFloat64, {row.tokens}, gpu);
    const auto g = vpce::TensorView::contiguous(upstream, vpce::kFloat32, {row.tokens}, gpu);
    const vpce::VocabShard shard{0, row.vocab, row.vocab};
    vpce::LossOptions options;
    options.stream = stream;
    vpce_bench::Loopback comm;
    vpce::Workspace workspace;
    cudaEvent_t a, b, c;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventCreate(&c);
    std::vector<float> forward_ms, backward_ms;
    int64_t wrong = 0;
    for (int it = 0; it < iterations + 2; ++it) {
      cudaEventRecord(a, stream);
      const vpce::Status forwarded = vpce::forward(comm, x, y, shard, options, l, e, {}, &workspace);
      cudaEventRecord(b, stream);
      const vpce::Status backwarded = forwarded.ok() ? vpce::backward(x, y, e, g, shard, options, x) : forwarded;
      cudaEventRecord(c, stream);
      if (!backwarded.ok()) {
        std::fprintf(stderr, "vpce: %s\n", backwarded.to_string().c_str());
        return 1;
      }
      cudaEventSynchronize(c);
      float f = 0, w = 0;
      cudaEventElapsedTime(&f, a, b);
      cudaEventElapsedTime(&w, b, c);
      if (it >= 2) {
        forward_ms.push_back(f);
        backward_ms.push_back(w);
      }
      if (it == 0) {  // check the first forward (before the in-place backward changed the logits)
        if (!workspace.device_status().ok()) ++wrong;
        std::vector<float> got(static_cast<std::size_t>(row.tokens));
        CHECK_CUDA(cudaMemcpy(got.data(), loss, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
        for (int sIndex = 0; sIndex < samples; ++sIndex) {
          const int64_t i = (sIndex * 7919) % row.tokens;
          double top = -INFINITY;
          for (float v : sampled[sIndex]) top = std::max(top, static_cast<double>(v));
          double sum = 0.0;
          for (float v : sampled[sIndex]) sum += std::exp(static_cast<double>(v) - top);
          const double want = top + std::log(sum) - sampled[sIndex][static_cast<std::size_t>(sampled_targets[sIndex])];
          if (!(std::fabs(got[static_cast<std::size_t>(i)] - want) <= 1e-5 * std::max(1.0, std::fabs(want)))) ++wrong;
        }
        // Refill: the timed iterations run on fresh logits again.
        if (row.bf16) {
          fill<<<4096, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(logits), n, targets, row.tokens, row.vocab, 7);
        } else {
          fill<<<4096, 256, 0, stream>>>(static_cast<float*>(logits), n, targets, row.tokens, row.vocab, 7);
        }
      }
    }
    const float fwd = vpce_bench::median(forward_ms);
    const float bwd = vpce_bench::median(backward_ms);
    const double gbs = 3.0 * static_cast<double>(bytes) / ((fwd + bwd) * 1e-3) / 1e9;
    std::printf("%10lld %8lld %5s %8.3f %8.3f %8.0f %6.1f %6lld\n", static_cast<long long>(row.tokens),
                static_cast<long long>(row.vocab), row.bf16 ? "bf16" : "fp32", fwd, bwd, gbs, 100.0 * gbs / copy_gbs,
                static_cast<long long>(wrong));
    total_wrong += wrong;
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaEventDestroy(c);
    cudaFree(logits);
    cudaFree(targets);
    cudaFree(loss);
    cudaFree(lse);
    cudaFree(upstream);
  }
  std::printf("# total #wrong: %lld\n", static_cast<long long>(total_wrong));
  return total_wrong == 0 ? 0 : 1;
}
