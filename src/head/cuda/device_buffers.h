// head/cuda/device_buffers.h: the fused head's device buffers and cuBLAS handle, kept in a
// Workspace between calls (grown with cudaMallocAsync, never while a graph is captured), and
// the GEMM every tile and gradient goes through (row-major, fp32 accumulation, no TF32).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "../../cuda/host.h"
#include "../../validate.h"

namespace vpce::detail::head_cuda {

inline constexpr std::size_t kCublasWorkspace = std::size_t{32} << 20;  // cuBLAS's recommendation on Hopper
inline constexpr std::size_t kAlign = 256;                              // every buffer's part starts on this

struct Buffer;
struct HeadBuffers;
struct Operand;

// kSystemError naming the cuBLAS call `what` and its status.
Status cublas_failure(const char* what, cublasStatus_t e);

// `bytes` rounded up to kAlign.
std::size_t round_up(std::size_t bytes);

// kInvalidUsage: `what` would have to be made while a CUDA graph is captured.
Status refuse_while_capturing(const char* what);

// The head's buffers of `state` for a call on `stream` (the caller made `device` current):
// ordered after the last call, the cuBLAS handle made (not while capturing), on `stream`,
// with its own workspace.
Status begin(std::shared_ptr<void>* state, int device, cudaStream_t stream, HeadBuffers** out);

// cuBLAS's name of an operand dtype (fp32, bf16, fp16).
cudaDataType_t cuda_type(DataType d);

// Row-major C[m, n] (fp32, row stride ldc) = op(A) op(B) + beta C, op(A) [m, k] (A stored
// [k, m] when trans_a), op(B) [k, n] (B stored [n, k] when trans_b); beta 0 or 1. In
// cuBLAS's column-major terms: C^T = op(B)^T op(A)^T.
Status gemm(cublasHandle_t handle, cudaStream_t stream, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
            const Operand& a, const Operand& b, float beta, float* c, int64_t ldc);

// c [rows, cols] (row stride ld) <- 0, on `stream`.
Status zero_matrix(float* c, int64_t rows, int64_t cols, int64_t ld, cudaStream_t stream);

// Elements [begin, begin + count) of v (a null base stays null).
TokenVector slice(const TokenVector& v, int64_t begin, int64_t count);

// "cuda:1", for messages.
std::string device_text(Device d);

struct Buffer {
  char* p = nullptr;
  std::size_t capacity = 0;
};

// The fused head's device buffers and cuBLAS handle, kept in Workspace::Buffers::device_head.
struct HeadBuffers {
  int device = -1;
  cublasHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;  // of the last call
  CallOrder order;                // of the calls on these buffers
  Buffer cublas, running, tile, hi, lo, hidden32, weight32, grad_hidden32, grad_weight32, bias_sums, partial, upstream,
      kept;  // (the RL outputs' chunked mode: every token's lse and E_p[z], fp64)

  Buffer* all() { return &cublas; }
  static constexpr int kBuffers = 13;

  HeadBuffers() = default;
  HeadBuffers(const HeadBuffers&) = delete;
  HeadBuffers& operator=(const HeadBuffers&) = delete;
  // Waits for the last call's work, which may still use the buffers, then frees them.
  ~HeadBuffers() {
    if (device < 0) return;
    CurrentDevice current(device);
    order.wait();
    Buffer* b = all();
    for (int k = 0; k < kBuffers; ++k) {
      if (b[k].p != nullptr) cudaFree(b[k].p);
    }
    if (handle != nullptr) cublasDestroy(handle);
  }

  // Grows `b` to `bytes` on `stream` (not while it is captured).
  Status grow(Buffer& b, std::size_t bytes) {
    if (bytes <= b.capacity) return {};
    bool captured = false;
    if (Status s = is_capturing(stream, &captured); !s.ok()) return s;
    if (captured) return refuse_while_capturing("device buffers");
    if (b.p != nullptr) {
      if (const cudaError_t e = cudaFreeAsync(b.p, stream); e != cudaSuccess) return cuda_failure("cudaFreeAsync", e);
    }
    b = Buffer{};
    if (const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&b.p), bytes, stream); e != cudaSuccess) {
      return cuda_failure("cudaMallocAsync of the fused head's workspace", e);
    }
    b.capacity = bytes;
    return {};
  }

  template <class T>
  T* as(const Buffer& b) const {
    return reinterpret_cast<T*>(b.p);
  }
};

// A GEMM operand: row-major, row stride ld elements.
struct Operand {
  const void* p;
  cudaDataType_t type;
  int64_t ld;
};

}  // namespace vpce::detail::head_cuda
