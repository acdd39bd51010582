// bench/blas_compare.cc: which of Debian's BLAS libraries runs the fused head's GEMMs
// fastest on this machine. Built once per library found (vpce_blas_compare_openblas,
// _blis, _onednn); each prints one table row per GEMM shape and thread count:
// the unfused training step's three GEMMs (logits, grad_hidden, grad_weight) at
// N x V x H, and the fused head's tile GEMMs. Row-major fp32 throughout, as vpce calls them.
//
//   vpce_blas_compare_onednn [N V H Nb Vb]   (defaults 4096 32000 1024 256 1024; OpenBLAS and
//   BLIS from Debian's libopenblas-openmp-dev and libblis-openmp-dev when installed)
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#if defined(VPCE_BENCH_OPENBLAS)
#include <cblas.h>
static const char* kLibrary = "OpenBLAS";
static void set_threads(int n) {
  openblas_set_num_threads(n);
  omp_set_num_threads(n);
}
// C[m, n] = alpha op(A) op(B) + beta C, row-major.
static void sgemm(bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
                  float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a, lda, b,
              ldb, beta, c, ldc);
}
#elif defined(VPCE_BENCH_BLIS)
#include <blis.h>
static const char* kLibrary = "BLIS";
static void set_threads(int n) { bli_thread_set_num_threads(n); }
static void sgemm(bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
                  float* c, int ldc) {
  float alpha = 1.0f;
  bli_sgemm(ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, m, n, k, &alpha,
            const_cast<float*>(a), lda, 1, const_cast<float*>(b), ldb, 1, &beta, c, ldc, 1);
}
#elif defined(VPCE_BENCH_ONEDNN)
#include <dnnl.h>
static const char* kLibrary = "oneDNN";
static void set_threads(int n) { omp_set_num_threads(n); }
static void sgemm(bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
                  float* c, int ldc) {
  dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}
#else
#error "define VPCE_BENCH_OPENBLAS, VPCE_BENCH_BLIS or VPCE_BENCH_ONEDNN"
#endif

namespace {

struct Shape {
  const char* name;
  bool ta, tb;
  long m, n, k;
};

std::vector<float> random_matrix(long elements, unsigned seed) {
  std::vector<float> v(static_cast<std::size_t>(elements));
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  for (float& x : v) x = d(gen);
  return v;
}

// Median seconds of `reps` calls after one warm-up.
double time_gemm(const Shape& s, int reps) {
  const long a_rows = s.ta ? s.k : s.m, a_cols = s.ta ? s.m : s.k;
  const long b_rows = s.tb ? s.n : s.k, b_cols = s.tb ? s.k : s.n;
  std::vector<float> a = random_matrix(a_rows * a_cols, 1), b = random_matrix(b_rows * b_cols, 2);
  std::vector<float> c(static_cast<std::size_t>(s.m * s.n), 0.0f);
  auto call = [&] {
    sgemm(s.ta, s.tb, static_cast<int>(s.m), static_cast<int>(s.n), static_cast<int>(s.k), a.data(),
          static_cast<int>(a_cols), b.data(), static_cast<int>(b_cols), 0.0f, c.data(), static_cast<int>(s.n));
  };
  call();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  long p[5] = {4096, 32000, 1024, 256, 1024};
  for (int i = 1; i < argc && i <= 5; ++i) p[i - 1] = std::atol(argv[i]);
  const long N = p[0], V = p[1], H = p[2], Nb = p[3], Vb = p[4];
  const Shape shapes[] = {
      {"step: logits h W^T", false, true, N, V, H},       {"step: grad_hidden dz W", false, false, N, H, V},
      {"step: grad_weight dz^T h", true, false, V, H, N}, {"tile: h_i W_j^T", false, true, Nb, Vb, H},
      {"tile: dz_ij W_j", false, false, Nb, H, Vb},       {"tile: dz_ij^T h_i", true, false, Vb, H, Nb},
  };
  std::printf("%-9s %-26s %7s %7s %7s %8s %10s %9s\n", "library", "gemm", "M", "N", "K", "threads", "ms", "GFLOP/s");
  for (int threads : {1, 2}) {
    set_threads(threads);
    for (const Shape& s : shapes) {
      const bool tile = std::string(s.name).rfind("tile", 0) == 0;
      const double sec = time_gemm(s, tile ? 21 : 3);
      std::printf("%-9s %-26s %7ld %7ld %7ld %8d %10.3f %9.1f\n", kLibrary, s.name, s.m, s.n, s.k, threads, sec * 1e3,
                  2.0 * s.m * s.n * s.k / sec * 1e-9);
    }
  }
  return 0;
}
