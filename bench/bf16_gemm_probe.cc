// bench/bf16_gemm_probe.cc: oneDNN's bf16 matmul (fp32 output) against its fp32 matmul and
// dnnl_sgemm on one thread, C[m, n] = op(A) op(B), in GFLOP/s, best of 5 rounds of 5 calls;
// prints the implementations oneDNN picked. Arguments m n k [trans_a trans_b] (default
// 512 1024 1024 0 1: the head's tile GEMM A B^T; the weight gradient's dx^T h is 1 0). Built
// by hand (docs/performance.md, entries 23 and 27): g++ -O2 -fopenmp bench/bf16_gemm_probe.cc -ldnnl
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <vector>

namespace {

using dnnl::memory;

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

template <class F>
double gflops(int64_t m, int64_t n, int64_t k, F call) {
  call();
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; ++i) call();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 5);
  }
  return 2.0 * static_cast<double>(m * n * k) / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  omp_set_num_threads(1);
  const int64_t m = argc > 3 ? std::atol(argv[1]) : 512, n = argc > 3 ? std::atol(argv[2]) : 1024,
                k = argc > 3 ? std::atol(argv[3]) : 1024;
  const bool trans_a = argc > 5 && std::atoi(argv[4]) != 0, trans_b = argc > 5 ? std::atoi(argv[5]) != 0 : true;
  std::vector<float> af(static_cast<size_t>(m * k)), bf(static_cast<size_t>(n * k)), c(static_cast<size_t>(m * n));
  std::vector<uint16_t> a(af.size()), b(bf.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = to_bf16(af[i] = static_cast<float>((i * 7919) % 1000) / 1000.0f - 0.5f);
  for (size_t i = 0; i < b.size(); ++i)
    b[i] = to_bf16(bf[i] = static_cast<float>((i * 104729) % 1000) / 1000.0f - 0.5f);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::desc cd({m, n}, memory::data_type::f32, memory::dims{n, 1});
  auto matmul = [&](memory::data_type type, void* pa, void* pb, const char* name) {
    // A stored [m, k] or (trans_a) [k, m]; B stored [k, n] or (trans_b) [n, k].
    const memory::desc ad({m, k}, type, trans_a ? memory::dims{1, m} : memory::dims{k, 1}),
        bd({k, n}, type, trans_b ? memory::dims{1, k} : memory::dims{n, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), attr, engine);
    const dnnl::matmul mm(pd);
    std::vector<char> scratch(pd.scratchpad_desc().get_size());
    memory am(ad, engine, pa), bm(bd, engine, pb), cm(cd, engine, c.data()),
        sm(pd.scratchpad_desc(), engine, scratch.data());
    const double g = gflops(m, n, k, [&] {
      mm.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}, {DNNL_ARG_SCRATCHPAD, sm}});
      stream.wait();
    });
    std::printf("%-12s %-24s %7.1f GFLOP/s\n", name, pd.impl_info_str(), g);
  };
  std::printf("# m %lld n %lld k %lld, A%s B%s, one thread\n", static_cast<long long>(m), static_cast<long long>(n),
              static_cast<long long>(k), trans_a ? "^T" : "", trans_b ? "^T" : "");
  matmul(memory::data_type::bf16, a.data(), b.data(), "bf16 matmul");
  matmul(memory::data_type::f32, af.data(), bf.data(), "f32 matmul");
  const double s = gflops(m, n, k, [&] {
    dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.0f, af.data(), trans_a ? m : k, bf.data(),
               trans_b ? k : n, 0.0f, c.data(), n);
  });
  std::printf("%-12s %-24s %7.1f GFLOP/s\n", "dnnl_sgemm", "", s);
}
