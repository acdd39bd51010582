// bench/port_probe.cc: what the instructions of vpce's half-precision loops cost on this CPU's
// vector ports, measured rather than taken from a model (docs/performance.md, issues 18 and
// 35). Each case runs a loop of 12 independent fused multiply-adds (12 chains: their 4-cycle
// latency never limits where two FMAs issue per cycle) plus 4 copies of the probed
// instruction, each independent of the others and of the FMAs. The FMAs alone (fma, or
// fma_ymm) are the yardstick, and 4 multiplications (vmulps, vmulps_ymm: one slot each)
// check it: a probed instruction's cost in FMA slots is
//     12 (t_probe / t_fma - 1) / 4
// (1: one slot of the ports the FMAs use, as a plain vector operation; 2: two
// micro-operations there, as bench/count_instructions.cc's weighted count assumes for the
// conversions; 0: it runs beside them, as additions do on AMD's separate add pipes). Time
// is per loop iteration; run pinned to one core, interleaved and repeated, and take the
// ratios within one run. The zmm rows need AVX-512 (VCVTNEPS2BF16 also AVX512-BF16), the
// ymm rows (what the AVX2 target runs: its bf16 widening and rounding, F16C's conversions,
// the exp's rounding, blends and tests, the maxima on values and on bit patterns) AVX2 with
// FMA; elsewhere a row reports an error. bench/cpu_check.py turns the rows into slots.
#include <benchmark/benchmark.h>

#include <hwy/targets.h>

#include <cstdint>

#include "cpu/simd_rows.h"

namespace {

// 12 FMAs on the registers of width R ("z": zmm, "y": ymm).
#define VPCE_FMA(R, k) "vfmadd132ps %%" R "mm12, %%" R "mm13, %%" R "mm" #k "\n\t"
// clang-format off
#define VPCE_FMAS(R)                                                                          \
  VPCE_FMA(R, 0) VPCE_FMA(R, 1) VPCE_FMA(R, 2) VPCE_FMA(R, 3) VPCE_FMA(R, 4) VPCE_FMA(R, 5)  \
  VPCE_FMA(R, 6) VPCE_FMA(R, 7) VPCE_FMA(R, 8) VPCE_FMA(R, 9) VPCE_FMA(R, 10) VPCE_FMA(R, 11)
// clang-format on
#define VPCE_ONE(R, k) "vmovaps %%" R "mm12, %%" R "mm" #k "\n\t"

// A loop of `iterations` (>= 1) times the FMAs and `probe`, on registers of width R. R12
// holds 1.0 and R13 0, so the FMAs keep their 1.0; R14 holds 1.0 too (ymm14: fp16 values
// from `buffer` for the zmm conversions) and the probes write R15 or EAX (renamed at each write: no
// dependency between the copies); `buffer` holds 256 bytes in L1 that the memory forms read
// and write.
#define VPCE_PROBE_LOOP_OF(R, probe)                                                                                \
  asm volatile("vbroadcastss (%[one]), %%" R "mm12\n\t vxorps %%xmm13, %%xmm13, %%xmm13\n\t" VPCE_ONE(R, 0)         \
                   VPCE_ONE(R, 1) VPCE_ONE(R, 2) VPCE_ONE(R, 3) VPCE_ONE(R, 4) VPCE_ONE(R, 5) VPCE_ONE(R, 6)        \
                       VPCE_ONE(R, 7) VPCE_ONE(R, 8) VPCE_ONE(R, 9) VPCE_ONE(R, 10) VPCE_ONE(R, 11) VPCE_ONE(R, 14) \
                           VPCE_ONE(R, 15) "1:\n\t" VPCE_FMAS(R) probe "dec %[n]\n\t jnz 1b\n\t vzeroupper\n\t"     \
               : [n] "+r"(iterations)                                                                               \
               : [one] "r"(&kOne), [buffer] "r"(buffer)                                                             \
               : "memory", "cc", "rax", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",     \
                 "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15")
#define VPCE_PROBE_LOOP(probe) VPCE_PROBE_LOOP_OF("z", probe)
#define VPCE_PROBE_LOOP_YMM(probe) VPCE_PROBE_LOOP_OF("y", probe)

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
  kScalefPs,          // VSCALEFPS, the exp's 2^(n + E)
  kCvtNe2Ps2Bf16,     // two fp32 vectors -> 32 bf16 (AVX512-BF16), the in-place bf16 gradient
  kPermW,             // VPERMW, which puts those 32 bf16 in order
  kTernLogD,          // VPTERNLOGD, a bitwise select of three vectors
  kMaxSw,             // VPMAXSW, the max of 32 fp16 or bf16 logits on their bit patterns
  // ymm (AVX2): what the AVX2 target's loops are made of
  kFmaYmm,       // the yardstick
  kMulPsYmm,     // one slot: the check
  kAddPsYmm,     // VADDPS: the FPU rounding (v + M) - M of bf16 pairs, the sums
  kSllDYmm,      // VPSLLD: bf16 -> fp32 widening (even elements), the exp's 2^n
  kAndYmm,       // VPAND: bf16 -> fp32 widening (odd elements), the masks
  kAddDYmm,      // VPADDD: the integer bf16 rounding, the exponent's E
  kBlendVPsYmm,  // VBLENDVPS: the exp's special cases, the target column
  kRoundPsYmm,   // VROUNDPS: the exp's n = round(z L)
  kCvtPs2DqYmm,  // VCVTPS2DQ: n as an integer
  kPackUsDwYmm,  // VPACKUSDW: bf16 pairs packed
  kPermQYmm,     // VPERMQ: their lanes in order
  kCvtPh2PsYmm,  // F16C fp16 -> fp32
  kCvtPs2PhYmm,  // F16C fp32 -> fp16
  kMaxPsYmm,     // VMAXPS: the running max of fp32 logits, the exp's clamp
  kCmpPsYmm,     // VCMPPS: the exp's test of its lanes
  kMaxUwYmm,     // VPMAXUW: the lowest 16-bit logit on its bit pattern (the clamp's test)
  kMaxSwYmm,     // VPMAXSW: the max of 16-bit logits on their bit patterns
  kBlendWYmm,    // VPBLENDW: the integer-rounded bf16 pairs merged
  kSubUsWYmm,    // VPSUBUSW: the in-place bf16 gradient's test of normal results
  kTestYmm,      // VPTEST: the same test's mask
  kZxWdYmm,      // VPMOVZXWD: 16-bit logits widened into 32-bit lanes
  kMovMskPsYmm,  // VMOVMSKPS: the exp's test of its lanes, into a general register
};

const char* const kNames[] = {"fma",
                              "vmulps",
                              "vcvtph2ps_m256",
                              "vcvtph2ps_ymm",
                              "vcvtps2ph_ymm",
                              "vcvtps2ph_m256",
                              "vcvtneps2bf16",
                              "vscalefps",
                              "vcvtne2ps2bf16",
                              "vpermw",
                              "vpternlogd",
                              "vpmaxsw",
                              "fma_ymm",
                              "vmulps_ymm",
                              "vaddps_ymm",
                              "vpslld_ymm",
                              "vpand_ymm",
                              "vpaddd_ymm",
                              "vblendvps_ymm",
                              "vroundps_ymm",
                              "vcvtps2dq_ymm",
                              "vpackusdw_ymm",
                              "vpermq_ymm",
                              "vcvtph2ps_xmm_ymm",
                              "vcvtps2ph_ymm_xmm",
                              "vmaxps_ymm",
                              "vcmpps_ymm",
                              "vpmaxuw_ymm",
                              "vpmaxsw_ymm",
                              "vpblendw_ymm",
                              "vpsubusw_ymm",
                              "vptest_ymm",
                              "vpmovzxwd_ymm",
                              "vmovmskps_ymm"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == kMovMskPsYmm + 1, "a name for every probe");

void run(Probe probe, int64_t iterations, void* buffer) {
  switch (probe) {
    case kFma: VPCE_PROBE_LOOP(""); break;
    case kMulPs: VPCE_PROBE_LOOP(VPCE_FOUR("vmulps %%zmm12, %%zmm14, %%zmm15\n\t")); break;
    case kCvtPh2PsMemory: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtph2ps (%[buffer]), %%zmm15\n\t")); break;
    case kCvtPh2PsRegister: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtph2ps %%ymm14, %%zmm15\n\t")); break;
    case kCvtPs2PhRegister: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtps2ph $8, %%zmm14, %%ymm15\n\t")); break;
    case kCvtPs2PhStore: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtps2ph $8, %%zmm14, 128(%[buffer])\n\t")); break;
    case kCvtNePs2Bf16: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtneps2bf16 %%zmm14, %%ymm15\n\t")); break;
    case kScalefPs: VPCE_PROBE_LOOP(VPCE_FOUR("vscalefps %%zmm14, %%zmm14, %%zmm15\n\t")); break;
    case kCvtNe2Ps2Bf16: VPCE_PROBE_LOOP(VPCE_FOUR("vcvtne2ps2bf16 %%zmm14, %%zmm12, %%zmm15\n\t")); break;
    case kPermW: VPCE_PROBE_LOOP(VPCE_FOUR("vpermw %%zmm14, %%zmm12, %%zmm15\n\t")); break;
    case kTernLogD:
      VPCE_PROBE_LOOP(VPCE_FOUR("vmovaps %%zmm14, %%zmm15\n\t vpternlogd $0xE4, %%zmm12, %%zmm13, %%zmm15\n\t"));
      break;
    case kMaxSw: VPCE_PROBE_LOOP(VPCE_FOUR("vpmaxsw %%zmm14, %%zmm12, %%zmm15\n\t")); break;
    case kFmaYmm: VPCE_PROBE_LOOP_YMM(""); break;
    case kMulPsYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vmulps %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kAddPsYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vaddps %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kSllDYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpslld $16, %%ymm14, %%ymm15\n\t")); break;
    case kAndYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpand %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kAddDYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpaddd %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kBlendVPsYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vblendvps %%ymm13, %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kRoundPsYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vroundps $8, %%ymm14, %%ymm15\n\t")); break;
    case kCvtPs2DqYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vcvtps2dq %%ymm14, %%ymm15\n\t")); break;
    case kPackUsDwYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpackusdw %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kPermQYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpermq $0xD8, %%ymm14, %%ymm15\n\t")); break;
    case kCvtPh2PsYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vcvtph2ps %%xmm14, %%ymm15\n\t")); break;
    case kCvtPs2PhYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vcvtps2ph $8, %%ymm14, %%xmm15\n\t")); break;
    case kMaxPsYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vmaxps %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kCmpPsYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vcmpltps %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kMaxUwYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpmaxuw %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kMaxSwYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpmaxsw %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kBlendWYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpblendw $0xAA, %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kSubUsWYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpsubusw %%ymm12, %%ymm14, %%ymm15\n\t")); break;
    case kTestYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vptest %%ymm12, %%ymm14\n\t")); break;
    case kZxWdYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vpmovzxwd %%xmm14, %%ymm15\n\t")); break;
    case kMovMskPsYmm: VPCE_PROBE_LOOP_YMM(VPCE_FOUR("vmovmskps %%ymm14, %%eax\n\t")); break;
  }
}

void BM_Probe(benchmark::State& state) {
  const auto probe = static_cast<Probe>(state.range(0));
  state.SetLabel(kNames[probe]);
  if (probe >= kFmaYmm) {
    if ((hwy::SupportedTargets() & HWY_AVX2) == 0) return state.SkipWithError("no AVX2 with FMA on this CPU");
  } else if ((hwy::SupportedTargets() & HWY_AVX3) == 0) {
    return state.SkipWithError("no AVX-512 on this CPU");
  }
  if ((probe == kCvtNePs2Bf16 || probe == kCvtNe2Ps2Bf16) && !vpce::detail::cpu_has_avx512_bf16()) {
    return state.SkipWithError("no AVX512-BF16 on this CPU");
  }
  alignas(64) uint16_t buffer[128];
  for (uint16_t& h : buffer) h = 0x3C00;  // fp16 1.0
  constexpr int64_t kIterations = 4096;
  for (auto _ : state) run(probe, kIterations, buffer);
  state.SetItemsProcessed(state.iterations() * kIterations);
}
BENCHMARK(BM_Probe)->DenseRange(kFma, kMovMskPsYmm);

}  // namespace

BENCHMARK_MAIN();
