// vpce/dlpack.h: conversion between vpce::TensorView and DLPack's DLTensor.
//
// Header-only and optional: include it only where <dlpack/dlpack.h> is available (Debian's
// libdlpack-dev, or the copy a framework ships). The conversion is lossless for tensors of
// at most TensorView::kMaxDims dimensions; DLPack's NULL strides (compact row-major) become
// explicit strides.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <limits>
#include <string>

#include "vpce/status.h"
#include "vpce/tensor.h"

namespace vpce {

inline Status from_dlpack(const DLTensor& tensor, TensorView* view) {
  if (view == nullptr) return {Code::kInvalidArgument, "view: expected a non-null pointer, got null"};
  if (tensor.ndim < 0 || tensor.ndim > TensorView::kMaxDims) {
    return {Code::kInvalidArgument, "tensor.ndim: expected a value in [0, " + std::to_string(TensorView::kMaxDims) +
                                        "], got " + std::to_string(tensor.ndim)};
  }
  if (tensor.ndim > 0 && tensor.shape == nullptr) {
    return {Code::kInvalidArgument, "tensor.shape: expected a non-null pointer, got null"};
  }
  TensorView out;
  out.data = tensor.data;
  out.device = Device{static_cast<DeviceType>(tensor.device.device_type), tensor.device.device_id};
  out.ndim = tensor.ndim;
  out.dtype = DataType{static_cast<TypeCode>(tensor.dtype.code), tensor.dtype.bits, tensor.dtype.lanes};
  int64_t compact = 1;
  for (int d = tensor.ndim - 1; d >= 0; --d) {
    out.shape[d] = tensor.shape[d];
    out.strides[d] = tensor.strides != nullptr ? tensor.strides[d] : compact;
    // Saturated where the size overflows int64 (a shape the checks then refuse), not UB.
    if (__builtin_mul_overflow(compact, tensor.shape[d], &compact)) compact = std::numeric_limits<int64_t>::max();
  }
  out.byte_offset = tensor.byte_offset;
  *view = out;
  return {};
}

// The DLTensor borrows view's shape and strides: it is valid while `view` is.
inline DLTensor to_dlpack(TensorView& view) {
  DLTensor out{};
  out.data = view.data;
  out.device = DLDevice{static_cast<DLDeviceType>(view.device.type), view.device.id};
  out.ndim = view.ndim;
  out.dtype = DLDataType{static_cast<uint8_t>(view.dtype.code), view.dtype.bits, view.dtype.lanes};
  out.shape = view.shape.data();
  out.strides = view.strides.data();
  out.byte_offset = view.byte_offset;
  return out;
}

}  // namespace vpce
