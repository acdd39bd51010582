// bench/cuda_head_perf.cu: the fused head (vpce/head.h) on one GPU against the three cuBLAS
// GEMMs of an unfused step of the same shapes. For each row (tokens N, hidden H, V per rank,
// bf16 operands), timed with CUDA events (median of -n after 2 warm-up runs):
//   fused:   linear_cross_entropy_forward + linear_cross_entropy_backward (recompute mode:
//            four GEMMs' worth of tiles, the bf16 gradient GEMMs in two parts)
//   chunked: linear_cross_entropy_forward_backward (mean loss)
//   fused16, dx16: fused and chunked with HeadOptions::bf16_logit_gradients (one bf16 GEMM
//            per gradient, as the unfused step's)
//   gemms:   logits = h W^T (bf16 out), grad_hidden = dlogits W (bf16 out), grad_weight +=
//            dlogits^T h (fp32), cublasGemmEx with fp32 compute: what an unfused step spends
//            in GEMMs alone (its loss kernels and the [N, V] logits' traffic come on top)
// with the GEMMs' TFLOP/s (2 N H V per GEMM), the memory the fused call held beyond its
// operands, the [N, V] bf16 logits it did not build, and #wrong: sampled tokens whose loss
// is off the fp64 value computed on the host from the same operands.
//
//   vpce_cuda_head_perf [iterations] [--quick]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_bench.cuh"
#include "vpce/head.h"
#include "vpce/vpce.h"

namespace {

#define CHECK_CUBLAS(call)                                                                           \
  do {                                                                                               \
    const cublasStatus_t e_ = (call);                                                                \
    if (e_ != CUBLAS_STATUS_SUCCESS) {                                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cublasGetStatusString(e_)); \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

#define CHECK_VPCE(call)                                               \
  do {                                                                 \
    const vpce::Status s_ = (call);                                    \
    if (!s_.ok()) {                                                    \
      std::fprintf(stderr, "%s: %s\n", #call, s_.to_string().c_str()); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

// N(0, sd) from a counter-based hash (Box-Muller), as bf16.
__global__ void fill(__nv_bfloat16* out, int64_t n, float sd, uint64_t seed) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[k] = __float2bfloat16_rn(sd * vpce_bench::normal_draw(seed, k));
  }
}

struct Row {
  int64_t tokens, hidden, vocab;
};

// Times f() on `stream`: median milliseconds of `iterations` after 2 warm-up runs.
template <class F>
float time_ms(cudaStream_t stream, int iterations, F&& f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int it = 0; it < iterations + 2; ++it) {
    cudaEventRecord(a, stream);
    f();
    cudaEventRecord(b, stream);
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    if (it >= 2) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return vpce_bench::median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  const auto [iterations, quick] = vpce_bench::parse_arguments(argc, argv);
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("# vpce_cuda_head_perf: %s, %d SMs, %.0f GiB; bf16 operands, fp32 accumulation; median of %d after 2\n",
              prop.name, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0, iterations);
  std::printf(
      "# fused = forward + backward (recompute), chunked = forward_backward, gemms = the 3 GEMMs of an "
      "unfused step\n");
  std::printf(
      "#  tokens hidden  V/rank fused(ms) fused16(ms) chunked(ms)  dx16(ms) gemms(ms) fused/gemms "
      "fused16/gemms  gemm TF/s  held(MiB) logits(MiB) #wrong\n");
  // The first row is the bar's shape: 8192 tokens, H 4096, V 131072 on one rank.
  std::vector<Row> rows = {
      {8192, 4096, 131072}, {4096, 4096, 32064}, {16384, 4096, 32064}, {16384, 4096, 64128}, {8192, 8192, 32064}};
  if (quick) rows.resize(2);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cublasHandle_t handle;
  CHECK_CUBLAS(cublasCreate(&handle));
  CHECK_CUBLAS(cublasSetStream(handle, stream));
  int64_t total_wrong = 0;
  const vpce::Device gpu{vpce::DeviceType::kCUDA, 0};
  for (const Row& row : rows) {
    const int64_t n = row.tokens, h = row.hidden, v = row.vocab;
    __nv_bfloat16 *hidden = nullptr, *weight = nullptr, *grad_hidden = nullptr, *logits = nullptr;
    float *grad_weight = nullptr, *loss = nullptr, *upstream = nullptr;
    double* lse = nullptr;
    int64_t* targets = nullptr;
    CHECK_CUDA(cudaMalloc(&hidden, n * h * 2));
    CHECK_CUDA(cudaMalloc(&weight, v * h * 2));
    CHECK_CUDA(cudaMalloc(&grad_hidden, n * h * 2));
    CHECK_CUDA(cudaMalloc(&grad_weight, v * h * 4));
    CHECK_CUDA(cudaMalloc(&loss, n * 4));
    CHECK_CUDA(cudaMalloc(&lse, n * sizeof(double)));
    CHECK_CUDA(cudaMalloc(&upstream, n * 4));
    CHECK_CUDA(cudaMalloc(&targets, n * 8));
    CHECK_CUDA(cudaMemset(grad_weight, 0, v * h * 4));
    fill<<<4096, 256>>>(hidden, n * h, 1.0f, 1);
    fill<<<4096, 256>>>(weight, v * h, 2.0f / std::sqrt(static_cast<float>(h)), 2);
    std::vector<int64_t> host_targets(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; ++i) host_targets[static_cast<std::size_t>(i)] = (i * 2654435761LL) % v;
    std::vector<float> ones(static_cast<std::size_t>(n), 1.0f);
    CHECK_CUDA(cudaMemcpy(targets, host_targets.data(), n * 8, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(upstream, ones.data(), n * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaDeviceSynchronize());

    const auto hv = vpce::TensorView::contiguous(hidden, vpce::kBFloat16, {n, h}, gpu);
    const auto wv = vpce::TensorView::contiguous(weight, vpce::kBFloat16, {v, h}, gpu);
    const vpce::HeadInputs inputs{hv, wv, nullptr};
    const auto yv = vpce::TensorView::contiguous(targets, vpce::kInt64, {n}, gpu);
    const auto lv = vpce::TensorView::contiguous(loss, vpce::kFloat32, {n}, gpu);
    const auto lm = vpce::TensorView::contiguous(loss, vpce::kFloat32, {1}, gpu);
    const auto ev = vpce::TensorView::contiguous(lse, vpce::kFloat64, {n}, gpu);
    const auto gv = vpce::TensorView::contiguous(upstream, vpce::kFloat32, {n}, gpu);
    const auto ghv = vpce::TensorView::contiguous(grad_hidden, vpce::kBFloat16, {n, h}, gpu);
    const auto gwv = vpce::TensorView::contiguous(grad_weight, vpce::kFloat32, {v, h}, gpu);
    vpce::HeadGradients grads;
    grads.hidden = {&ghv, false};
    grads.weight = {&gwv, true};  // Megatron's main_grad
    const vpce::VocabShard shard{0, v, v};
    vpce::LossOptions options;
    options.stream = stream;
    vpce::HeadOptions head;
    vpce_bench::Loopback comm;
    vpce::Workspace workspace;

    std::size_t free_before = 0, free_after = 0, total = 0;
    CHECK_CUDA(cudaMemGetInfo(&free_before, &total));
    // Correctness first: the forward's loss on sampled tokens against fp64 on the host.
    CHECK_VPCE(vpce::linear_cross_entropy_forward(comm, inputs, yv, shard, options, head, lv, ev, {}, &workspace));
    CHECK_VPCE(workspace.device_status());
    int64_t wrong = 0;
    {
      std::vector<uint16_t> w_host(static_cast<std::size_t>(v * h)), h_host(static_cast<std::size_t>(h));
      std::vector<float> got(static_cast<std::size_t>(n));
      CHECK_CUDA(cudaMemcpy(w_host.data(), weight, v * h * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(got.data(), loss, n * 4, cudaMemcpyDeviceToHost));
      std::vector<float> w_float(w_host.size());
      for (std::size_t k = 0; k < w_host.size(); ++k) w_float[k] = vpce_bench::bf16_value(w_host[k]);
      for (int s = 0; s < 4; ++s) {
        const int64_t i = (s * 7919) % n;
        CHECK_CUDA(cudaMemcpy(h_host.data(), hidden + i * h, h * 2, cudaMemcpyDeviceToHost));
        std::vector<double> hrow(static_cast<std::size_t>(h));
        for (int64_t k = 0; k < h; ++k)
          hrow[static_cast<std::size_t>(k)] = vpce_bench::bf16_value(h_host[static_cast<std::size_t>(k)]);
        std::vector<double> z(static_cast<std::size_t>(v));
        double top = -INFINITY;
        for (int64_t c = 0; c < v; ++c) {
          double sum = 0.0;
          const float* wr = w_float.data() + c * h;
          for (int64_t k = 0; k < h; ++k) sum += hrow[static_cast<std::size_t>(k)] * wr[k];
          z[static_cast<std::size_t>(c)] = sum;
          top = std::max(top, sum);
        }
        double sum = 0.0;
        for (double x : z) sum += std::exp(x - top);
        const double want =
            top + std::log(sum) - z[static_cast<std::size_t>(host_targets[static_cast<std::size_t>(i)])];
        if (!(std::fabs(got[static_cast<std::size_t>(i)] - want) <= 1e-4 * std::max(1.0, std::fabs(want)))) ++wrong;
      }
    }
    const float fused = time_ms(stream, iterations, [&] {
      CHECK_VPCE(vpce::linear_cross_entropy_forward(comm, inputs, yv, shard, options, head, lv, ev, {}, &workspace));
      CHECK_VPCE(
          vpce::linear_cross_entropy_backward(inputs, yv, ev, gv, shard, options, head, grads, nullptr, &workspace));
    });
    vpce::LossOptions mean = options;
    mean.reduction = vpce::Reduction::kMean;
    const float chunked = time_ms(stream, iterations, [&] {
      CHECK_VPCE(vpce::linear_cross_entropy_forward_backward(comm, inputs, yv, shard, mean, head, 1.0f, lm, ev, grads,
                                                             {}, &workspace));
    });
    vpce::HeadOptions dx16 = head;
    dx16.bf16_logit_gradients = true;
    const float fused_dx16 = time_ms(stream, iterations, [&] {
      CHECK_VPCE(vpce::linear_cross_entropy_forward(comm, inputs, yv, shard, options, dx16, lv, ev, {}, &workspace));
      CHECK_VPCE(
          vpce::linear_cross_entropy_backward(inputs, yv, ev, gv, shard, options, dx16, grads, nullptr, &workspace));
    });
    const float chunked_dx16 = time_ms(stream, iterations, [&] {
      CHECK_VPCE(vpce::linear_cross_entropy_forward_backward(comm, inputs, yv, shard, mean, dx16, 1.0f, lm, ev, grads,
                                                             {}, &workspace));
    });
    CHECK_CUDA(cudaStreamSynchronize(stream));
    CHECK_CUDA(cudaMemGetInfo(&free_after, &total));
    CHECK_VPCE(workspace.device_status());
    const double held_mib = static_cast<double>(free_before - std::min(free_before, free_after)) / 1048576.0;

    // The unfused step's three GEMMs (row-major, expressed column-major as in vpce).
    const float one = 1.0f, zero = 0.0f;
    CHECK_CUDA(cudaMalloc(&logits, n * v * 2));
    const float gemms = time_ms(stream, iterations, [&] {
      // logits [N, V] = h W^T
      CHECK_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(v), static_cast<int>(n),
                                static_cast<int>(h), &one, weight, CUDA_R_16BF, static_cast<int>(h), hidden,
                                CUDA_R_16BF, static_cast<int>(h), &zero, logits, CUDA_R_16BF, static_cast<int>(v),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      // grad_hidden [N, H] = dlogits W (the logits stand in for their gradient)
      CHECK_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(h), static_cast<int>(n),
                                static_cast<int>(v), &one, weight, CUDA_R_16BF, static_cast<int>(h), logits,
                                CUDA_R_16BF, static_cast<int>(v), &zero, grad_hidden, CUDA_R_16BF, static_cast<int>(h),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      // grad_weight [V, H] += dlogits^T h
      CHECK_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(h), static_cast<int>(v),
                                static_cast<int>(n), &one, hidden, CUDA_R_16BF, static_cast<int>(h), logits,
                                CUDA_R_16BF, static_cast<int>(v), &one, grad_weight, CUDA_R_32F, static_cast<int>(h),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    const double flops = 3.0 * 2.0 * static_cast<double>(n) * static_cast<double>(h) * static_cast<double>(v);
    std::printf("%9lld %6lld %7lld %9.3f %11.3f %11.3f %9.3f %9.3f %11.2f %13.2f %10.0f %10.0f %11.0f %6lld\n",
                static_cast<long long>(n), static_cast<long long>(h), static_cast<long long>(v), fused, fused_dx16,
                chunked, chunked_dx16, gemms, fused / gemms, fused_dx16 / gemms, flops / (gemms * 1e-3) / 1e12,
                held_mib, static_cast<double>(n * v * 2) / 1048576.0, static_cast<long long>(wrong));
    std::fflush(stdout);
    total_wrong += wrong;
    for (void* p : {static_cast<void*>(hidden), static_cast<void*>(weight), static_cast<void*>(grad_hidden),
                    static_cast<void*>(logits), static_cast<void*>(grad_weight), static_cast<void*>(loss),
                    static_cast<void*>(lse), static_cast<void*>(upstream), static_cast<void*>(targets)}) {
      cudaFree(p);
    }
  }
  cublasDestroy(handle);
  std::printf("# total #wrong: %lld\n", static_cast<long long>(total_wrong));
  return total_wrong == 0 ? 0 : 1;
}
