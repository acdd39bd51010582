// bench/port_probe.cc: what the instructions of vpce's half-precision loops cost on this CPU's
// 512-bit vector ports, measured rather than taken from a model (docs/performance.md, issue
// 18). Each case runs a loop of 12 independent fused multiply-adds on zmm registers (12
// chains: their 4-cycle latency never limits where two FMAs issue per cycle) plus 4 copies of
// the probed instruction, each independent of the others and of the FMAs. The FMAs alone
// (BM_Probe/fma) are the yardstick, and 4 multiplications (BM_Probe/vmulps, one slot each)
// check it: a probed instruction's cost in FMA slots is
//     12 (t_probe / t_fma - 1) / 4
// (1: one slot of the ports the FMAs use, as a plain vector operation; 2: two
// micro-operations there, as bench/count_instructions.cc's weighted count assumes for the
// conversions; 0: it runs beside them). Time is per loop iteration; run pinned to one core,
// interleaved and repeated, and take the ratios within one run. AVX-512 CPUs only (the
// conversions' zmm forms; VCVTNEPS2BF16 also needs AVX512-BF16); elsewhere the rows report an
// error instead of a time.
#include <benchmark/benchmark.h>

#include <hwy/targets.h>

#include <cstdint>

#include "cpu/simd_rows.h"

namespace {

#define VPCE_FMAS                                                                                        \
  "vfmadd132ps %%zmm12, %%zmm13, %%zmm0\n\t vfmadd132ps %%zmm12, %%zmm13, %%zmm1\n\t"                   \
  "vfmadd132ps %%zmm12, %%zmm13, %%zmm2\n\t vfmadd132ps %%zmm12, %%zmm13, %%zmm3\n\t"                   \
  "vfmadd132ps %%zmm12, %%zmm13, %%zmm4\n\t vfmadd132ps %%zmm12, %%zmm13, %%zmm5\n\t"                   \
  "vfmadd132ps %%zmm12, %%zmm13, %%zmm6\n\t vfmadd132ps %%zmm12, %%zmm13, %%zmm7\n\t"                   \
  "vfmadd132ps %%zmm12, %%zmm13, %%zmm8\n\t vfmadd132ps %%zmm12, %%zmm13, %%zmm9\n\t"                   \
  "vfmadd132ps %%zmm12, %%zmm13, %%zmm10\n\t vfmadd132ps %%zmm12, %%zmm13, %%zmm11\n\t"

// A loop of `iterations` (>= 1) times the FMAs and `probe`. zmm12 holds 1.0 and zmm13 0, so
// the FMAs keep their 1.0; zmm14 holds 1.0 too (ymm14: fp16 values from `buffer`) and the
// probes write zmm15 (renamed at each write: no dependency between the copies); `buffer`
// holds 256 bytes in L1 that the memory forms read and write.
#define VPCE_PROBE_LOOP(probe)                                                                           \
  asm volatile(                                                                                          \
      "vbroadcastss (%[one]), %%zmm12\n\t vxorps %%xmm13, %%xmm13, %%xmm13\n\t"                          \
      "vmovaps %%zmm12, %%zmm0\n\t vmovaps %%zmm12, %%zmm1\n\t vmovaps %%zmm12, %%zmm2\n\t"              \
      "vmovaps %%zmm12, %%zmm3\n\t vmovaps %%zmm12, %%zmm4\n\t vmovaps %%zmm12, %%zmm5\n\t"              \
      "vmovaps %%zmm12, %%zmm6\n\t vmovaps %%zmm12, %%zmm7\n\t vmovaps %%zmm12, %%zmm8\n\t"              \
      "vmovaps %%zmm12, %%zmm9\n\t vmovaps %%zmm12, %%zmm10\n\t vmovaps %%zmm12, %%zmm11\n\t"            \
      "vmovaps %%zmm12, %%zmm14\n\t vmovaps %%zmm12, %%zmm15\n\t"                                        \
      "1:\n\t" VPCE_FMAS probe "dec %[n]\n\t jnz 1b\n\t vzeroupper\n\t"                                  \
      : [n] "+r"(iterations)                                                                             \
      : [one] "r"(&kOne), [buffer] "r"(buffer)                                                           \
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
        "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15")

#define VPCE_FOUR(instruction) instruction instruction instruction instruction

constexpr float kOne = 1.0f;

enum Probe : int {
  kFma,               // the yardstick: the FMAs alone
  kMulPs,             // VMULPS: one slot, the check of the yardstick
  kCvtPh2PsMemory,    // fp16 -> fp32 from memory, as the kernels load fp16 logits
  kCvtPh2PsRegister,  // the same from a register
  kCvtPs2PhRegister,  // fp32 -> fp16 into a register
  kCvtPs2PhStore,     // fp32 -> fp16 into memory, as the in-place fp16 gradient is written
  kCvtNePs2Bf16,      // fp32 -> bf16 (AVX512-BF16)
  kReducePs,          // VREDUCEPS, the exp's f = t - floor(t)
  kScalefPs,          // VSCALEFPS, the exp's 2^floor(t)
  kCvtNe2Ps2Bf16,     // two fp32 vectors -> 32 bf16 (AVX512-BF16), the in-place bf16 gradient
  kPermW,             // VPERMW, which puts those 32 bf16 in order
  kTernLogD,          // VPTERNLOGD, the software bf16 rounding's packing
  kMaxSw,             // VPMAXSW, the max of 32 fp16 or bf16 logits on their bit patterns
};

const char* const kNames[] = {"fma",       "vmulps",        "vcvtph2ps_m256", "vcvtph2ps_ymm",
                              "vcvtps2ph_ymm", "vcvtps2ph_m256", "vcvtneps2bf16", "vreduceps",
                              "vscalefps", "vcvtne2ps2bf16", "vpermw",     "vpternlogd", "vpmaxsw"};

void run(Probe probe, int64_t iterations, void* buffer) {
  switch (probe) {
    case kFma: VPCE_PROBE_LOOP(""); break;
    case kMulPs: VPCE_PROBE_LOOP(VPCE_FOUR("vmulps %%zmm12, %%zmm14, %%zmm15\n\t")); break;
    case kCvtPh2PsMemory: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtph2ps (%[buffer]), %%zmm15\n\t")); break;
    case kCvtPh2PsRegister: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtph2ps %%ymm14, %%zmm15\n\t")); break;
    case kCvtPs2PhRegister: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtps2ph $8, %%zmm14, %%ymm15\n\t")); break;
    case kCvtPs2PhStore: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtps2ph $8, %%zmm14, 128(%[buffer])\n\t")); break;
    case kCvtNePs2Bf16: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtneps2bf16 %%zmm14, %%ymm15\n\t")); break;
    case kReducePs: VPCE_PROBE_LOOP(VPCE_FOUR("vreduceps $9, %%zmm14, %%zmm15\n\t")); break;
    case kScalefPs: VPCE_PROBE_LOOP(VPCE_FOUR("vscalefps %%zmm14, %%zmm14, %%zmm15\n\t")); break;
    case kCvtNe2Ps2Bf16: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtne2ps2bf16 %%zmm14, %%zmm12, %%zmm15\n\t")); break;
    case kPermW: VPCE_PROBE_LOOP(VPCE_FOUR("vpermw %%zmm14, %%zmm12, %%zmm15\n\t")); break;
    case kTernLogD: VPCE_PROBE_LOOP(VPCE_FOUR("vmovaps %%zmm14, %%zmm15\n\t vpternlogd $0xE4, %%zmm12, %%zmm13, %%zmm15\n\t")); break;
    case kMaxSw: VPCE_PROBE_LOOP(VPCE_FOUR("vpmaxsw %%zmm14, %%zmm12, %%zmm15\n\t")); break;
  }
}

void BM_Probe(benchmark::State& state) {
  const auto probe = static_cast<Probe>(state.range(0));
  state.SetLabel(kNames[probe]);
  if ((hwy::SupportedTargets() & HWY_AVX3) == 0) return state.SkipWithError("no AVX-512 on this CPU");
  if ((probe == kCvtNePs2Bf16 || probe == kCvtNe2Ps2Bf16) && !vpce::detail::cpu_has_avx512_bf16()) {
    return state.SkipWithError("no AVX512-BF16 on this CPU");
  }
  alignas(64) uint16_t buffer[128];
  for (uint16_t& h : buffer) h = 0x3C00;  // fp16 1.0
  constexpr int64_t kIterations = 4096;
  for (auto _ : state) run(probe, kIterations, buffer);
  state.SetItemsProcessed(state.iterations() * kIterations);
}
BENCHMARK(BM_Probe)->DenseRange(kFma, kMaxSw);

}  // namespace

BENCHMARK_MAIN();
