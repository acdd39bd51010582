// tests/cuda/cuda_support.h: what the CUDA tests share: whether a device is here (each test
// skips, saying why, without one), a one-rank device communicator (a copy on the stream, so
// whole steps can be captured), R ranks as threads on one device (their gathers staged
// through the in-process backend: NCCL needs one GPU per rank), and device buffers.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "vpce/communicator.h"
#include "vpce/tensor.h"

namespace vpce::test {

inline bool have_device(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    *why = e != cudaSuccess ? cudaGetErrorString(e) : "no devices";
    return false;
  }
  return true;
}

#define REQUIRE_GPU()                                                              \
  do {                                                                             \
    std::string why;                                                               \
    if (!have_device(&why)) GTEST_SKIP() << "no CUDA device here (" << why << ")"; \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

inline const Device kGpu{DeviceType::kCUDA, 0};

// One rank on the device: the gather is a copy, asynchronous on the stream.
class DeviceLoopback final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* name() const override { return "device loopback"; }
  Status all_gather(const void*, void*, std::size_t) override { return {Code::kUnsupported, "host"}; }
  Status device_all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    ++calls;
    return cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)) ==
                   cudaSuccess
               ? Status{}
               : Status{Code::kSystemError, "cudaMemcpyAsync"};
  }
  int calls = 0;
};

// R ranks as threads on one device: each gather waits for the rank's stream, goes through
// the in-process backend on the host and back.
class StagedDeviceComm final : public Communicator {
 public:
  explicit StagedDeviceComm(Communicator& host) : host_(host) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  const char* name() const override { return "staged device"; }
  Status all_gather(const void*, void*, std::size_t) override { return {Code::kUnsupported, "host"}; }
  Status device_all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    auto s = static_cast<cudaStream_t>(stream);
    std::vector<char> mine(bytes), all(bytes * static_cast<std::size_t>(size()));
    if (cudaMemcpyAsync(mine.data(), send, bytes, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess) {
      return {Code::kSystemError, "staging the send buffer"};
    }
    if (Status st = host_.all_gather(mine.data(), all.data(), bytes); !st.ok()) return st;
    if (cudaMemcpyAsync(recv, all.data(), all.size(), cudaMemcpyHostToDevice, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess) {
      return {Code::kSystemError, "staging the receive buffer"};
    }
    ++calls;
    return {};
  }
  int calls = 0;

 private:
  Communicator& host_;
};

// A device copy of a host buffer (zeros for none), freed at the end of the test.
struct DeviceBuffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  DeviceBuffer(const void* host, std::size_t n) : bytes(n) {
    cudaMalloc(&p, n + 16);
    if (host != nullptr) {
      cudaMemcpy(p, host, n, cudaMemcpyHostToDevice);
    } else {
      cudaMemset(p, 0, n + 16);
    }
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  std::vector<T> read(std::size_t count) const {
    std::vector<T> out(count);
    cudaMemcpy(out.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost);
    return out;
  }
};

}  // namespace vpce::test
