// head/gemm.cc: gemm() through oneDNN (see gemm.h): its matmul primitive (brgemm kernels)
// where A is not transposed and K is at most 8192, dnnl_sgemm otherwise; gemm_bf16() through
// the matmul primitive with bf16 operands (its brgemm kernels take a transposed A too).
//
// Why two: on an Ice Lake's AVX-512 (2026-12-01) the matmul primitive runs the head's tile
// shapes 5-15 % faster than dnnl_sgemm (and 30 % faster for grad_hidden at H = 512), but for
// a transposed A (the weight gradient's dx^T h) oneDNN 2.6 has no brgemm kernel and picks the
// same JIT GEMM as dnnl_sgemm; and over a K of 32000 it was slower (bench/blas_compare.cc).
#include "gemm.h"

#include <map>
#include <optional>
#include <tuple>
#include <vector>

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "../cpu/dtype.h"
#include "../cpu/simd_rows.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace vpce::detail {
namespace {

// oneDNN's OpenMP runtime takes its thread count from omp_get_max_threads() (1 inside a
// parallel region); this makes it 1 on the calling thread for the call, and restores it.
class OneThread {
 public:
#if defined(_OPENMP)
  OneThread() : previous_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(previous_); }

 private:
  int previous_;
#endif
};

// A GEMM's shape, strides and operand type (fp32, or bf16 for A and B): the key of its
// primitive. A is [m, k] (trans_a: stored [k, m]), B is [k, n] (trans_b: stored [n, k]).
struct MatmulShape {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b, add, bf16;
  bool operator<(const MatmulShape& o) const {
    return std::tie(m, n, k, lda, ldb, ldc, trans_a, trans_b, add, bf16) <
           std::tie(o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.trans_a, o.trans_b, o.add, o.bf16);
  }
};

struct Matmul {
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c, scratchpad;
};

// One thread's primitives (the head's calls have a handful of shapes: the tiles and their
// edges), its engine, stream and scratchpad. Primitives are made once per shape and thread.
class ThreadMatmuls {
 public:
  // Null when oneDNN has no matmul for the shape (then dnnl_sgemm runs it).
  const Matmul* get(const MatmulShape& s) {
    auto it = cache_.find(s);
    if (it == cache_.end()) {
      // Bounded: varying batch sizes give varying edge tiles, each a shape of its own.
      if (cache_.size() >= kMaxShapes) cache_.clear();
      it = cache_.emplace(s, make(s)).first;
      if (it->second && scratch_.size() < it->second->scratchpad.get_size()) {
        scratch_.resize(it->second->scratchpad.get_size());
      }
    }
    return it->second ? &*it->second : nullptr;
  }
  // With the descriptors it was made for, a CPU matmul's execution has nothing left to fail.
  void run(const Matmul& mm, const void* a, const void* b, float* c) {
    using dnnl::memory;
    memory am(mm.a, engine_, const_cast<void*>(a)), bm(mm.b, engine_, const_cast<void*>(b)), cm(mm.c, engine_, c);
    memory sm(mm.scratchpad, engine_, scratch_.data());
    mm.primitive.execute(stream_,
                         {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}, {DNNL_ARG_SCRATCHPAD, sm}});
    stream_.wait();
  }

 private:
  std::optional<Matmul> make(const MatmulShape& s) {
    using dnnl::memory;
    try {
      const memory::data_type operands = s.bf16 ? memory::data_type::bf16 : memory::data_type::f32;
      const memory::desc a({s.m, s.k}, operands, s.trans_a ? memory::dims{1, s.lda} : memory::dims{s.lda, 1});
      const memory::desc b({s.k, s.n}, operands, s.trans_b ? memory::dims{1, s.ldb} : memory::dims{s.ldb, 1});
      const memory::desc c({s.m, s.n}, memory::data_type::f32, memory::dims{s.ldc, 1});
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      if (s.add) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
      }
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, engine_);
      return Matmul{dnnl::matmul(pd), a, b, c, pd.scratchpad_desc()};
    } catch (const dnnl::error&) {
      return std::nullopt;
    }
  }

  static constexpr std::size_t kMaxShapes = 64;
  dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{engine_};
  std::vector<std::byte> scratch_;
  std::map<MatmulShape, std::optional<Matmul>> cache_;
};

// Above this K (the chunked mode's dh = dx W over the whole shard) the primitive ran slower
// than dnnl_sgemm here (K = 32000, H = 1024: 113 against 134 GFLOP/s on one thread).
constexpr int64_t kMatmulMaxK = 8192;

ThreadMatmuls& thread_matmuls() {
  thread_local ThreadMatmuls matmuls;
  return matmuls;
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0f) {
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = 0.0f;
      }
    }
    return;
  }
  [[maybe_unused]] OneThread one;  // (empty without OpenMP)
  if (!trans_a && k <= kMatmulMaxK) {
    ThreadMatmuls& matmuls = thread_matmuls();
    if (const Matmul* mm = matmuls.get({m, n, k, lda, ldb, ldc, false, trans_b, beta != 0.0f, false})) {
      matmuls.run(*mm, a, b, c);
      return;
    }
  }
  // The arguments were validated by the caller (sizes fit, strides >= row lengths), so
  // oneDNN's own checks cannot fail.
  static_cast<void>(dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc));
}

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0 || k == 0) {
    gemm(trans_a, trans_b, m, n, 0, nullptr, 1, nullptr, 1, beta, c, ldc);
    return;
  }
  {
    [[maybe_unused]] OneThread one;  // (empty without OpenMP)
    ThreadMatmuls& matmuls = thread_matmuls();
    if (const Matmul* mm = matmuls.get({m, n, k, lda, ldb, ldc, trans_a, trans_b, beta != 0.0f, true})) {
      matmuls.run(*mm, a, b, c);
      return;
    }
  }
  // No bf16 matmul for this shape (oneDNN without a bf16 implementation on this CPU): the
  // operands widened (a shift) as stored, and the fp32 GEMM.
  thread_local std::vector<float> wide_a, wide_b;
  auto widen = [](const uint16_t* x, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& out) {
    out.resize(static_cast<std::size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) widen_bf16(x + r * ld, cols, out.data() + r * cols);
  };
  widen(a, trans_a ? k : m, trans_a ? m : k, lda, wide_a);
  widen(b, trans_b ? n : k, trans_b ? k : n, ldb, wide_b);
  gemm(trans_a, trans_b, m, n, k, wide_a.data(), trans_a ? m : k, wide_b.data(), trans_b ? k : n, beta, c, ldc);
}

bool bf16_gemm_native() {
  // oneDNN's ISAs nest: one that includes avx512_core_bf16 has all of its bits.
  static const bool available =
      cpu_has_avx512_bf16() && (static_cast<unsigned>(dnnl_get_effective_cpu_isa()) & dnnl_cpu_isa_avx512_core_bf16) ==
                                   dnnl_cpu_isa_avx512_core_bf16;
  return available && bf16_instructions_allowed();
}

}  // namespace vpce::detail
