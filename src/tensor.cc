// tensor.cc: constructors and printing for TensorView, DataType and Device.
#include "vpce/tensor.h"

#include <algorithm>

namespace vpce {

std::string to_string(DataType dtype) {
  if (dtype.lanes == 1) {
    if (dtype == kFloat32) return "float32";
    if (dtype == kFloat16) return "float16";
    if (dtype == kBFloat16) return "bfloat16";
    if (dtype == kFloat64) return "float64";
    if (dtype == kInt32) return "int32";
    if (dtype == kInt64) return "int64";
  }
  return "code " + std::to_string(static_cast<int>(dtype.code)) + " bits " +
         std::to_string(dtype.bits) + " lanes " + std::to_string(dtype.lanes);
}

std::string to_string(Device device) {
  switch (device.type) {
    case DeviceType::kCPU: return "cpu";
    case DeviceType::kCUDA: return "cuda:" + std::to_string(device.id);
  }
  return "device type " + std::to_string(static_cast<int>(device.type)) + ":" +
         std::to_string(device.id);
}

namespace {

// ndim = -1 marks a view built with too many dimensions; validation rejects it by name.
TensorView make_view(const void* data, DataType dtype, std::initializer_list<int64_t> shape,
                     Device device) {
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

TensorView TensorView::contiguous(const void* data, DataType dtype,
                                  std::initializer_list<int64_t> shape, Device device) {
  TensorView view = make_view(data, dtype, shape, device);
  int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
  return view;
}

TensorView TensorView::strided(const void* data, DataType dtype,
                               std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  TensorView view = make_view(data, dtype, shape, device);
  if (view.ndim >= 0 && strides.size() != shape.size()) {
    view.ndim = -1;
    return view;
  }
  if (view.ndim > 0) std::copy(strides.begin(), strides.end(), view.strides.begin());
  return view;
}

TensorView TensorView::matrix(const void* data, DataType dtype, int64_t rows, int64_t cols,
                              int64_t row_stride, Device device) {
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
