// tensor.cc: constructors and printing for TensorView, DataType and Device.
#include "vpce/tensor.h"

#include <algorithm>
#include <limits>

namespace vpce {

std::string to_string(DataType dtype) {
  // DLPack's type codes by name (3: opaque handle, 5: complex, 6: bool), as NumPy and
  // PyTorch spell them: "uint8", "bool", "complex64"; lanes as a suffix ("float32x4").
  std::string name;
  switch (static_cast<int>(dtype.code)) {
    case 0: name = "int" + std::to_string(dtype.bits); break;
    case 1: name = "uint" + std::to_string(dtype.bits); break;
    case 2: name = "float" + std::to_string(dtype.bits); break;
    case 3: name = "opaque handle"; break;
    case 4: name = dtype.bits == 16 ? "bfloat16" : "bfloat" + std::to_string(dtype.bits); break;
    case 5: name = "complex" + std::to_string(dtype.bits); break;
    case 6: name = dtype.bits == 8 ? "bool" : "bool" + std::to_string(dtype.bits); break;
    default:
      return "unknown dtype (code " + std::to_string(static_cast<int>(dtype.code)) + ", " + std::to_string(dtype.bits) +
             " bits, " + std::to_string(dtype.lanes) + " lanes)";
  }
  return dtype.lanes == 1 ? name : name + "x" + std::to_string(dtype.lanes);
}

std::string to_string(Device device) {
  switch (device.type) {
    case DeviceType::kCPU: return "cpu";
    case DeviceType::kCUDA: return "cuda:" + std::to_string(device.id);
  }
  return "device type " + std::to_string(static_cast<int>(device.type)) + ":" + std::to_string(device.id);
}

namespace {

// ndim = -1 marks a view built with too many dimensions; validation rejects it by name.
TensorView make_view(const void* data, DataType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorView view;
  view.data = const_cast<void*>(data);  // views are non-owning; inputs are never written
  view.dtype = dtype;
  view.device = device;
  if (shape.size() > static_cast<size_t>(TensorView::kMaxDims)) {
    view.ndim = -1;
    return view;
  }
  view.ndim = static_cast<int32_t>(shape.size());
  std::copy(shape.begin(), shape.end(), view.shape.begin());
  return view;
}

}  // namespace

TensorView TensorView::contiguous(const void* data, DataType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  TensorView view = make_view(data, dtype, shape, device);
  int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.strides[d] = stride;
    // Saturated where the size overflows int64 (a shape the checks then refuse), not UB.
    if (__builtin_mul_overflow(stride, view.shape[d], &stride)) stride = std::numeric_limits<int64_t>::max();
  }
  return view;
}

TensorView TensorView::strided(const void* data, DataType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  TensorView view = make_view(data, dtype, shape, device);
  if (view.ndim >= 0 && strides.size() != shape.size()) {
    view.ndim = -1;
    return view;
  }
  if (view.ndim > 0) std::copy(strides.begin(), strides.end(), view.strides.begin());
  return view;
}

TensorView TensorView::matrix(const void* data, DataType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                              Device device) {
  return strided(data, dtype, {rows, cols}, {row_stride, 1}, device);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim && d < kMaxDims; ++d) {
    if (shape[d] < 0 || __builtin_mul_overflow(n, shape[d], &n)) return -1;
  }
  return n;
}

}  // namespace vpce
