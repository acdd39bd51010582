// bench/cuda_bench.cuh: what the CUDA benchmarks (cuda_perf.cu, cuda_head_perf.cu) share:
// CHECK_CUDA, the command line, a one-rank device communicator, N(0, 1) draws from a
// counter-based hash, the median of the timed runs and a bf16's value on the host.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "vpce/vpce.h"

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace vpce_bench {

// One rank on the device: the gather is a device-to-device copy on the stream.
class Loopback final : public vpce::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* name() const override { return "loopback"; }
  vpce::Status all_gather(const void*, void*, std::size_t) override { return {vpce::Code::kUnsupported, "host"}; }
  vpce::Status device_all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    const cudaError_t e =
        cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
    return e == cudaSuccess ? vpce::Status{} : vpce::Status{vpce::Code::kSystemError, cudaGetErrorString(e)};
  }
};

// SplitMix64's finaliser: a counter's 64 well-mixed bits.
__host__ __device__ inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The k-th N(0, 1) draw of `seed` (Box-Muller of one hash: 24 bits each for u1 in (0, 1]
// and u2 in [0, 1)).
__device__ inline float normal_draw(uint64_t seed, int64_t k) {
  const uint64_t h = mix(seed + static_cast<uint64_t>(k));
  const float u1 = (static_cast<float>(h >> 40) + 1.0f) / 16777217.0f;
  const float u2 = static_cast<float>(h & 0xffffff) / 16777216.0f;
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

// The command line of both: `NAME [iterations] [--quick]` (10 iterations by default); a
// count that is not a positive number, or another argument, exits 2 with the usage.
struct Arguments {
  int iterations = 10;
  bool quick = false;
};
inline Arguments parse_arguments(int argc, char** argv) {
  Arguments a;
  for (int k = 1; k < argc; ++k) {
    char* end = nullptr;
    const long count = std::strtol(argv[k], &end, 10);
    if (std::strcmp(argv[k], "--quick") == 0) {
      a.quick = true;
    } else if (k == 1 && end != argv[k] && *end == '\0' && count > 0 && count <= 100000) {
      a.iterations = static_cast<int>(count);
    } else {
      std::fprintf(stderr, "%s: unexpected argument '%s'\nusage: %s [iterations, 1 to 100000] [--quick]\n", argv[0],
                   argv[k], argv[0]);
      std::exit(2);
    }
  }
  return a;
}

inline float median(std::vector<float> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

inline float bf16_value(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace vpce_bench
