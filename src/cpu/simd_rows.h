// cpu/simd_rows.h: the per-block SIMD work of the kernels (Google Highway, dispatched at run
// time to the best of AVX-512, AVX2, SSE4, SSSE3 or scalar that the CPU supports).
//
// A block is up to kBlockColumns consecutive logits of one row. kernels.cc splits rows into
// blocks at fixed column offsets (never by thread count) and folds the blocks' statistics
// in column order, so the results do not depend on the number of threads.
#pragma once

#include <cstdint>
#include <string>

#include "../common/token_math.h"

namespace vpce::detail {

inline constexpr int64_t kBlockColumns = 16384;

enum class StorageType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// z = x * scale, then cap * tanh(x * scale * inverse_cap) when cap > 0, whose slope is
// slope_scale (1 - tanh^2): token_math.h's RowTransform (the temperature rides in them).
struct TransformParams {
  float scale = 1.0f;
  float cap = 0.0f;
  float inverse_cap = 0.0f;
  float slope_scale = 1.0f;
  bool identity() const { return scale == 1.0f && cap == 0.0f; }
};

// Statistics of one block, relative to its own max.
struct BlockStats {
  float max = -__builtin_inff();
  int64_t argmax = -1;      // first column (in the block) holding max; -1 if none
  double sum_exp = 0.0;     // sum exp(z - max)
  double sum_logits = 0.0;  // sum (z - logit_reference(max)) (when asked; token_math.h)
  double weighted = 0.0;    // sum exp(z - max) (z - max) (when asked)
  double squares = 0.0;     // sum exp(2 (z - max)) (with `weighted`)
  int64_t columns = 0;      // the columns these statistics cover
};

// Folds block b (whose columns start `offset` after block a's) into a, in column order.
void fold_block(BlockStats& a, const BlockStats& b, int64_t offset);

// row: [cols] of `type` -> the block's statistics (with_weighted: also the squares).
BlockStats block_stats(const void* row, StorageType type, int64_t cols, const TransformParams& t, bool with_sum_logits,
                       bool with_weighted);

// row: [cols] of `in` -> grad: [cols] of `out`,
// grad_v = upstream (exp(z_v - lse) coefficient - uniform) dz/dx_v. grad may be row.
void block_gradient(const void* row, StorageType in, void* grad, StorageType out, int64_t cols,
                    const TransformParams& t, const GradientConstants& c);

// z and dz/dx of one logit, with the same arithmetic as the blocks.
float transform_one(float x, const TransformParams& t);
float slope_one(float x, const TransformParams& t);
// e^(x - s) with the same arithmetic as the blocks (ExpShifted in cpu/simd/exp-inl.h).
float exp_shifted_one(float x, float s);
// y[v] = e^(x[v] - s) for v in [0, n) (y may be x): the vectorised exp alone, for tests and
// (with s = 0, as the blocks compute it) for `vpce perf`'s bound.
void exp_shifted_lanes(const float* x, float s, float* y, int64_t n);
// Whether this CPU's target takes e^(x - s) with x itself as the exponential's argument (with
// FMA, other than AVX-512), so that its error does not grow with |x - s|.
bool exp_argument_is_exact();
// x: [n] fp32 -> out: [n] of `type`, rounded as the kernels store a gradient (bf16 with
// AVX512-BF16's instructions where they are used), for tests.
void store_lanes(const float* x, StorageType type, void* out, int64_t n);
// x: [n] fp32 -> out: [n] bf16 as the in-place bf16 gradient's loop stores pairs of vectors,
// for tests.
void store_bf16_pairs(const float* x, uint16_t* out, int64_t n);
// destination[0, bytes) = source[0, bytes) with non-temporal stores (the lines go to memory,
// not to the caches, and are not read first), for `vpce perf`.
void stream_copy(void* destination, const void* source, int64_t bytes);
// row: [cols] of `type` -> its max (NaN if any element is NaN, -inf for cols = 0), writing
// the row widened to fp32 into `widened` (when not null) in the same read.
float row_max(const void* row, StorageType type, int64_t cols, float* widened);
// row: [cols] fp32, in place: row[v] <- exp(row[v] - shift) (the difference rounded to fp32,
// then vpce's Cody-Waite exp on every target); returns the sum of the new values (fp64
// across chunks of 64 vectors).
double exp_row_in_place(float* row, int64_t cols, float shift);
// The name of the SIMD target the kernels run on ("AVX3", "AVX2", ...).
const char* simd_target_name();
// Restricts the kernels to the SIMD target `name` (as simd_target_name gives it), to time one
// target's code on a CPU that has a better one (`vpce perf --simd-target`,
// bench/kernels_bench.cc --target); "" restores the best. Returns "" or, where this CPU cannot
// run that target or it was not built, what the error names: the targets it can.
std::string use_simd_target(const std::string& name);
// use_simd_target's error for `name`, without selecting it ("" where it would succeed).
std::string simd_target_error(const std::string& name);
// Whether the AVX3 kernels may round bf16 gradients with AVX512-BF16's VCVTNE(2)PS2BF16 on a
// CPU that has them (true by default). Tests and bench/count_instructions.cc turn it off so
// that such a CPU also runs the software rounding that CPUs without them take.
void set_bf16_instructions_allowed(bool allowed);
bool bf16_instructions_allowed();
// Whether an fp32 gradient in its own buffer is written with non-temporal stores (true by
// default: the lines go to memory without being read first). bench/kernels_bench.cc turns it
// off to time the out-of-place gradient in cache, where the arithmetic limits.
void set_streaming_stores_allowed(bool allowed);
bool streaming_stores_allowed();
// Whether this CPU has AVX512-BF16.
bool cpu_has_avx512_bf16();

}  // namespace vpce::detail
