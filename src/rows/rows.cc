// rows/rows.cc: the composable row kernels of vpce/rows.h: argument checks, then rows over
// threads, each row's SIMD work in cpu/simd_rows.cc.
#include "vpce/rows.h"

#include "cpu/parallel.h"
#include "cpu/simd_rows.h"
#include "validate.h"

namespace vpce {
namespace {

using detail::RowMatrix;
using detail::TokenVector;

detail::StorageType storage_of(DataType dtype) {
  return dtype == kFloat32    ? detail::StorageType::kFloat32
         : dtype == kBFloat16 ? detail::StorageType::kBFloat16
                              : detail::StorageType::kFloat16;
}

Status check_threads(int num_threads) { return detail::check_thread_count("num_threads", num_threads); }

// The row kernels are the CPU's: a device's memory would be read as the host's.
Status check_host(const TensorView& t, const char* name) {
  if (t.device.type == DeviceType::kCPU) return {};
  return {Code::kInvalidArgument, detail::expected_got((std::string(name) + ".device").c_str(),
                                                       "cpu (the row kernels run on the host)", to_string(t.device))};
}

// A [..., K] view of host memory.
Status as_host_rows(const TensorView& t, const char* name, RowMatrix* out) {
  if (Status s = check_host(t, name); !s.ok()) return s;
  return detail::as_row_matrix(t, name, out);
}

// A float32 [..., K] matrix named `name` with as many rows and columns as `like`.
Status as_float_matrix_like(const TensorView& t, const char* name, const RowMatrix& like, RowMatrix* out) {
  if (Status s = as_host_rows(t, name, out); !s.ok()) return s;
  if (Status s = detail::check_dtype(name, out->dtype, {kFloat32}, "float32"); !s.ok()) return s;
  if (out->rows != like.rows || out->cols != like.cols) {
    return {Code::kInvalidArgument,
            detail::expected_got((std::string(name) + ".shape").c_str(),
                                 std::to_string(like.rows) + " rows of " + std::to_string(like.cols),
                                 std::to_string(out->rows) + " rows of " + std::to_string(out->cols))};
  }
  return {};
}

Status as_float_rows(const TensorView& t, const char* name, int64_t rows, TokenVector* out) {
  if (Status s = check_host(t, name); !s.ok()) return s;
  if (Status s = detail::as_token_vector(t, name, rows, out); !s.ok()) return s;
  return detail::check_dtype(name, out->dtype, {kFloat32}, "float32");
}

}  // namespace

Status row_max(const TensorView& logits, const TensorView& max, const TensorView* widened, int num_threads) {
  RowMatrix x, wide;
  TokenVector m;
  if (Status s = check_threads(num_threads); !s.ok()) return s;
  if (Status s = as_host_rows(logits, "logits", &x); !s.ok()) return s;
  if (Status s =
          detail::check_dtype("logits", x.dtype, {kFloat32, kBFloat16, kFloat16}, "float32, bfloat16 or float16");
      !s.ok()) {
    return s;
  }
  if (Status s = as_float_rows(max, "max", x.rows, &m); !s.ok()) return s;
  if (widened != nullptr) {
    if (Status s = as_float_matrix_like(*widened, "widened", x, &wide); !s.ok()) return s;
    if (detail::overlaps(wide.begin_byte(), wide.end_byte(), x.begin_byte(), x.end_byte())) {
      return {Code::kInvalidArgument,
              detail::expected_got("widened", "memory that does not overlap the logits", "overlapping memory")};
    }
  }
  if (detail::overlaps(m.base, m.end_byte(), x.begin_byte(), x.end_byte()) ||
      (widened != nullptr && detail::overlaps(m.base, m.end_byte(), wide.begin_byte(), wide.end_byte()))) {
    return {Code::kInvalidArgument,
            detail::expected_got("max", "memory that does not overlap the logits or widened", "overlapping memory")};
  }
  const detail::StorageType type = storage_of(x.dtype);
  const int bytes = x.dtype.bytes();
  detail::parallel_rows(x.rows, num_threads, [&](int64_t i) {
    float* out = widened != nullptr ? wide.row<float>(i) : nullptr;
    m.at<float>(i) = detail::row_max(x.base + i * x.row_stride * bytes, type, x.cols, out);
  });
  return {};
}

Status exp_rows_in_place(const TensorView& x, const TensorView& shift, const TensorView* sums, int num_threads) {
  RowMatrix rows;
  TokenVector s, total;
  if (Status st = check_threads(num_threads); !st.ok()) return st;
  if (Status st = as_host_rows(x, "x", &rows); !st.ok()) return st;
  if (Status st = detail::check_dtype("x", rows.dtype, {kFloat32}, "float32"); !st.ok()) return st;
  if (Status st = as_float_rows(shift, "shift", rows.rows, &s); !st.ok()) return st;
  if (sums != nullptr) {
    if (Status st = as_float_rows(*sums, "sums", rows.rows, &total); !st.ok()) return st;
    if (detail::overlaps(total.base, total.end_byte(), rows.begin_byte(), rows.end_byte()) ||
        detail::overlaps(total.base, total.end_byte(), s.base, s.end_byte())) {
      return {Code::kInvalidArgument,
              detail::expected_got("sums", "memory that does not overlap x or shift", "overlapping memory")};
    }
  }
  if (detail::overlaps(s.base, s.end_byte(), rows.begin_byte(), rows.end_byte())) {
    return {Code::kInvalidArgument,
            detail::expected_got("shift", "memory that does not overlap x", "overlapping memory")};
  }
  detail::parallel_rows(rows.rows, num_threads, [&](int64_t i) {
    const double sum = detail::exp_row_in_place(rows.row<float>(i), rows.cols, s.at<float>(i));
    if (sums != nullptr) total.at<float>(i) = static_cast<float>(sum);
  });
  return {};
}

const char* cpu_kernel_target() { return detail::simd_target_name(); }

}  // namespace vpce
