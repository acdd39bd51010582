// vpce/tensor.h: a non-owning view of a tensor, field for field DLPack's DLTensor.
//
// The codes of DeviceType and TypeCode are DLPack's own values, and TensorView has the
// fields of DLTensor (data, device, ndim, dtype, shape, strides, byte_offset), so the two
// convert losslessly (vpce/dlpack.h does it). Differences, for C++ convenience: shape and
// strides are stored inline (at most kMaxDims dimensions) and strides are always explicit,
// in elements. vpce never writes through a view that it takes as an input.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace vpce {

enum class DeviceType : int32_t { kCPU = 1, kCUDA = 2 };  // DLDeviceType values

struct Device {
  DeviceType type = DeviceType::kCPU;
  int32_t id = 0;
};

enum class TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4 };  // DLDataTypeCode

struct DataType {
  TypeCode code = TypeCode::kFloat;
  uint8_t bits = 32;
  uint16_t lanes = 1;

  friend bool operator==(const DataType&, const DataType&) = default;
  int bytes() const { return (bits * lanes + 7) / 8; }
};

inline constexpr DataType kFloat32{TypeCode::kFloat, 32, 1};
inline constexpr DataType kFloat16{TypeCode::kFloat, 16, 1};
inline constexpr DataType kBFloat16{TypeCode::kBfloat, 16, 1};
inline constexpr DataType kFloat64{TypeCode::kFloat, 64, 1};
inline constexpr DataType kInt32{TypeCode::kInt, 32, 1};
inline constexpr DataType kInt64{TypeCode::kInt, 64, 1};

// "float32", "bfloat16", "int64", or "code 3 bits 8 lanes 1" for anything else.
std::string to_string(DataType dtype);
// "cpu" or "cuda:0".
std::string to_string(Device device);

struct TensorView {
  static constexpr int kMaxDims = 8;

  void* data = nullptr;
  Device device{};
  int32_t ndim = 0;
  DataType dtype{};
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements, never implied
  uint64_t byte_offset = 0;

  // Row-major (C order) view of `shape`.
  static TensorView contiguous(const void* data, DataType dtype, std::initializer_list<int64_t> shape,
                               Device device = {});
  // View with explicit strides (in elements); shape and strides have the same length.
  static TensorView strided(const void* data, DataType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = {});
  // rows x cols, row r starting at data + r * row_stride elements.
  static TensorView matrix(const void* data, DataType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                           Device device = {});

  // The number of elements, or -1 if a dimension is negative or the count overflows.
  int64_t numel() const;
  // Address of the first element: data + byte_offset (null when data is null).
  void* first() const { return data == nullptr ? nullptr : static_cast<char*>(data) + byte_offset; }
};

}  // namespace vpce
