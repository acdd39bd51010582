// head/cuda/device_buffers.cc: the fused head's device buffers and GEMMs (device_buffers.h).
#include "device_buffers.h"

#include <string>

namespace vpce::detail::head_cuda {

Status cublas_failure(const char* what, cublasStatus_t e) {
  return {Code::kSystemError, std::string("cublas: ") + what + ": " + cublasGetStatusString(e)};
}

std::size_t round_up(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

Status refuse_while_capturing(const char* what) {
  return {Code::kInvalidUsage, std::string("workspace: expected ") + what +
                                   " already made when capturing a CUDA graph (run one call of this size first), "
                                   "got a call that needs more"};
}

// The head's buffers of `state` for a call on `stream` (the caller made `device` current):
// ordered after the last call, the cuBLAS handle made (not while capturing), on `stream`,
// with its own workspace.
Status begin(std::shared_ptr<void>* state, int device, cudaStream_t stream, HeadBuffers** out) {
  if (!*state) *state = std::make_shared<HeadBuffers>();
  auto& b = *static_cast<HeadBuffers*>(state->get());
  if (b.device >= 0 && b.device != device) {
    return {Code::kInvalidUsage, "workspace: expected the device of its first fused-head call, cuda:" +
                                     std::to_string(b.device) + ", got cuda:" + std::to_string(device)};
  }
  // The last call may have run on another stream and still use these buffers.
  if (Status s = b.order.before(stream); !s.ok()) return s;
  b.device = device;
  b.stream = stream;
  if (b.handle == nullptr) {
    bool captured = false;
    if (Status s = is_capturing(stream, &captured); !s.ok()) return s;
    if (captured) return refuse_while_capturing("a cuBLAS handle");
    if (const cublasStatus_t e = cublasCreate(&b.handle); e != CUBLAS_STATUS_SUCCESS) {
      b.handle = nullptr;
      return cublas_failure("cublasCreate", e);
    }
    // fp32 means fp32: no TF32, no reduced-precision reductions.
    if (const cublasStatus_t e = cublasSetMathMode(
            b.handle,
            static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
        e != CUBLAS_STATUS_SUCCESS) {
      return cublas_failure("cublasSetMathMode", e);
    }
  }
  if (Status s = b.grow(b.cublas, kCublasWorkspace); !s.ok()) return s;
  // cublasSetStream resets the workspace: set it after. A workspace of our own keeps the
  // GEMMs deterministic and lets them be captured.
  if (const cublasStatus_t e = cublasSetStream(b.handle, stream); e != CUBLAS_STATUS_SUCCESS) {
    return cublas_failure("cublasSetStream", e);
  }
  if (const cublasStatus_t e = cublasSetWorkspace(b.handle, b.cublas.p, b.cublas.capacity);
      e != CUBLAS_STATUS_SUCCESS) {
    return cublas_failure("cublasSetWorkspace", e);
  }
  *out = &b;
  return {};
}

cudaDataType_t cuda_type(DataType d) { return d == kFloat32 ? CUDA_R_32F : d == kBFloat16 ? CUDA_R_16BF : CUDA_R_16F; }

// Row-major C[m, n] (fp32, row stride ldc) = op(A) op(B) + beta C, op(A) [m, k] (A stored
// [k, m] when trans_a), op(B) [k, n] (B stored [n, k] when trans_b); beta 0 or 1. In
// cuBLAS's column-major terms: C^T = op(B)^T op(A)^T.
Status gemm(cublasHandle_t handle, cudaStream_t stream, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
            const Operand& a, const Operand& b, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return {};
  if (k == 0) {
    if (beta != 0.0f) return {};
    const cudaError_t e =
        cudaMemset2DAsync(c, static_cast<std::size_t>(ldc) * sizeof(float), 0,
                          static_cast<std::size_t>(n) * sizeof(float), static_cast<std::size_t>(m), stream);
    return e == cudaSuccess ? Status{} : cuda_failure("cudaMemset2DAsync", e);
  }
  const float alpha = 1.0f;
  const cublasStatus_t e = cublasGemmEx(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, b.p, b.type, static_cast<int>(b.ld), a.p, a.type,
      static_cast<int>(a.ld), &beta, c, CUDA_R_32F, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return e == CUBLAS_STATUS_SUCCESS ? Status{} : cublas_failure("cublasGemmEx", e);
}

Status zero_matrix(float* c, int64_t rows, int64_t cols, int64_t ld, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return {};
  const cudaError_t e =
      cudaMemset2DAsync(c, static_cast<std::size_t>(ld) * sizeof(float), 0,
                        static_cast<std::size_t>(cols) * sizeof(float), static_cast<std::size_t>(rows), stream);
  return e == cudaSuccess ? Status{} : cuda_failure("cudaMemset2DAsync", e);
}

TokenVector slice(const TokenVector& v, int64_t begin, int64_t count) {
  TokenVector out = v;
  out.n = count;
  if (v.base != nullptr) out.base = v.base + begin * v.stride * v.dtype.bytes();
  return out;
}

std::string device_text(Device d) { return to_string(d); }

}  // namespace vpce::detail::head_cuda
