// cpu/dtype.h: the storage types of logits and gradients, and their conversion to and
// from fp32. Math is always fp32; low-precision values are widened on load and rounded
// once, to nearest even, on store (NaN stays NaN, overflow becomes infinity).
#pragma once

#include <bit>
#include <cstdint>
#include <cmath>
#include <cstring>

#include "vpce/tensor.h"

namespace vpce::detail {

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }

inline float to_float(Float16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | sign);
  }
  if (exponent == 31) {  // infinity or NaN
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

template <class T>
T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

template <>
inline BFloat16 from_float<BFloat16>(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN
    return BFloat16{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  }
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>((bits + rounding) >> 16)};
}

template <>
inline Float16 from_float<Float16>(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint16_t out = 0;
  if (bits >= 0x47800000u) {  // |x| >= 65536, infinity or NaN
    out = bits > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (bits < 0x38800000u) {  // below 2^-14: a subnormal or zero result
    // Adding 0.5 aligns the result's mantissa to the bottom of the fp32 mantissa, and the
    // fp32 addition rounds it to nearest even.
    const float aligned = std::bit_cast<float>(bits) + 0.5f;
    out = static_cast<uint16_t>(std::bit_cast<uint32_t>(aligned) - 0x3f000000u);
  } else {
    const uint32_t odd = (bits >> 13) & 1u;
    bits += 0xc8000fffu + odd;  // rebias the exponent (-112 << 23) and round to nearest even
    out = static_cast<uint16_t>(bits >> 13);
  }
  return Float16{static_cast<uint16_t>(out | (sign >> 16))};
}

// The element at `p` of a float32, bfloat16 or float16 tensor, widened to fp32.
inline float widen(const void* p, DataType dtype) {
  if (dtype == kFloat32) {
    float x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  }
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return dtype == kBFloat16 ? to_float(BFloat16{bits}) : to_float(Float16{bits});
}

// n bfloat16 values (their bit patterns) widened to fp32: a shift, one loop the compiler
// vectorises.
inline void widen_bf16(const uint16_t* bits, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(static_cast<uint32_t>(bits[i]) << 16);
}

// n fp32 values rounded to bfloat16 (to nearest even; NaN stays NaN) into `out`, which may
// be `in` itself: the rounded row then fills the first half of the row's bytes. Pieces go
// through local buffers (memcpy), so that no value is written before it is read and the
// aliasing is defined.
inline void narrow_bf16(const float* in, int64_t n, uint16_t* out) {
  constexpr int64_t kPiece = 256;
  float values[kPiece];
  uint16_t bits[kPiece];
  for (int64_t i = 0; i < n; i += kPiece) {
    const int64_t count = n - i < kPiece ? n - i : kPiece;
    std::memcpy(values, in + i, static_cast<std::size_t>(count) * sizeof(float));
    for (int64_t j = 0; j < count; ++j) bits[j] = from_float<BFloat16>(values[j]).bits;
    std::memcpy(out + i, bits, static_cast<std::size_t>(count) * sizeof(uint16_t));
  }
}

// n fp32 values rounded to bfloat16's values in place (still fp32).
inline void round_to_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = to_float(from_float<BFloat16>(x[i]));
}

// Stores `value` at `p`, rounded once to float32, bfloat16 or float16.
inline void narrow(float value, void* p, DataType dtype) {
  if (dtype == kFloat32) {
    std::memcpy(p, &value, sizeof(value));
  } else if (dtype == kBFloat16) {
    const BFloat16 b = from_float<BFloat16>(value);
    std::memcpy(p, &b, sizeof(b));
  } else {
    const Float16 h = from_float<Float16>(value);
    std::memcpy(p, &h, sizeof(h));
  }
}

// Stores an fp64 `value` at `p`, rounded once to float32, bfloat16 or float16 (to nearest
// even): for the narrower two, first to float32 rounded to odd (toward zero, the last bit set
// where that was inexact), which keeps the information that makes the second rounding the
// correct one (float32 has more than two bits beyond bfloat16's and float16's).
inline void narrow(double value, void* p, DataType dtype) {
  auto f = static_cast<float>(value);
  if (dtype != kFloat32 && static_cast<double>(f) != value && std::isfinite(f)) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(value)) f = std::nextafter(f, 0.0f);
    uint32_t bits = 0;
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= 1u;
    std::memcpy(&f, &bits, sizeof(bits));
  }
  narrow(f, p, dtype);
}

}  // namespace vpce::detail
