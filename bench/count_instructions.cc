// bench/count_instructions.cc: instructions retired per logit by the kernels' passes and by
// the exp that `vpce perf`'s bound times, on every SIMD target this CPU runs, counted
// exactly by single-stepping a forked child under ptrace (no performance counters needed;
// valgrind, which would also count, does not run AVX-512). The model of an exp-bound
// machine that docs/performance.md uses: it retires instructions at one rate, so a row's
// predicted %bound is 2 E / K, with E the exp's instructions per element (the bound counts
// two exponentials per logit) and K the forward's plus the backward's per logit. A second
// prediction (wpred) weighs each instruction by the slots of the 512-bit FMA ports it takes on
// Intel's AVX-512 cores, as bench/port_probe.cc measured them (docs/performance.md, entry 31):
// 1 for every vector operation but VCVTPH2PS (2, from memory too), VCVTPS2PH into a register
// (2; into memory 1), VCVTNEPS2BF16 (3), VCVTNE2PS2BF16 (3.5) and VPERMW (2).
//
// Built with the benchmarks (x86-64 Linux, linked -no-pie); run after scripts/build.sh:
//   build/bench/vpce_count_instructions [AVX3,AVX2]    (the targets to count; all by default)
// With VPCE_COUNT_TRACE=DIR each pass's instruction trace goes to DIR, for bench/mca_trace.py
// (llvm-mca's CPU models; docs/performance.md, Method, says how far to trust them), and for
// bench/cpu_check.py, which weighs them by the port probe's slots on the CPU it runs on.
#include <hwy/targets.h>
#include <signal.h>
#include <sys/ptrace.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/simd_rows.h"

namespace vpce::detail {
namespace {

// What one instruction is, from its encoding (VEX and EVEX only: the AVX2 and AVX-512 targets;
// the SSE targets' legacy encodings count as other).
enum Kind { kVectorOp, kVectorMemory, kVectorMove, kOther };

// The fields of a VEX or EVEX instruction that tell it apart.
struct Encoding {
  bool vex_or_evex = false;
  int map = 0, pp = 0;  // opcode map (1 0F, 2 0F38, 3 0F3A); implied prefix (1 66, 2 F3, 3 F2)
  bool w = false;       // VEX.W or EVEX.W
  unsigned char opcode = 0;
  bool memory = false;  // a memory operand (ModRM.mod != 3)
};

Encoding decode(const unsigned char* b) {
  int i = 0;
  while (i < 4 && (b[i] == 0x66 || b[i] == 0xf2 || b[i] == 0xf3 || (b[i] >= 0x40 && b[i] <= 0x4f))) ++i;
  Encoding e;
  int opcode_at = 0;
  if (b[i] == 0xc5) {
    e.map = 1, e.pp = b[i + 1] & 0x03, opcode_at = i + 2;
  } else if (b[i] == 0xc4) {
    e.map = b[i + 1] & 0x1f, e.pp = b[i + 2] & 0x03, e.w = (b[i + 2] & 0x80) != 0, opcode_at = i + 3;
  } else if (b[i] == 0x62) {
    e.map = b[i + 1] & 0x07, e.pp = b[i + 2] & 0x03, e.w = (b[i + 2] & 0x80) != 0, opcode_at = i + 4;
  } else {
    return e;
  }
  e.vex_or_evex = true;
  e.opcode = b[opcode_at];
  e.memory = (b[opcode_at + 1] >> 6) != 3;
  return e;
}

Kind classify(const Encoding& e) {
  if (!e.vex_or_evex) return kOther;
  const unsigned char op = e.opcode;
  const bool move = e.map == 1 && (op == 0x10 || op == 0x11 || op == 0x28 || op == 0x29 || op == 0x6f || op == 0x7f ||
                                   op == 0x2b || op == 0xe7);
  const bool broadcast = e.map == 2 && (op == 0x18 || op == 0x58 || op == 0x59 || op == 0x78 || op == 0x79);
  if (move || broadcast) return e.memory ? kVectorMemory : kVectorMove;
  return kVectorOp;
}

// The slots of the 512-bit FMA ports a vector operation takes on Intel's AVX-512 cores, as
// bench/port_probe.cc measured them (the weighted prediction's weights).
double intel_slots(const Encoding& e) {
  if (e.map == 2 && e.opcode == 0x13 && e.pp == 1) return 2.0;                   // VCVTPH2PS (66)
  if (e.map == 3 && e.opcode == 0x1d && e.pp == 1) return e.memory ? 1.0 : 2.0;  // VCVTPS2PH (66)
  if (e.map == 2 && e.opcode == 0x72 && e.pp == 2) return 3.0;                   // VCVTNEPS2BF16 (F3)
  if (e.map == 2 && e.opcode == 0x72 && e.pp == 3) return 3.5;                   // VCVTNE2PS2BF16 (F2)
  if (e.map == 2 && e.opcode == 0x8d && e.pp == 1 && e.w) return 2.0;            // VPERMW (66, W1)
  return 1.0;
}

struct Counts {
  double all = 0, vector_ops = 0, memory = 0, moves = 0, weighted = 0;  // weighted: in Intel's port slots
  Counts operator-(const Counts& o) const {
    return {all - o.all, vector_ops - o.vector_ops, memory - o.memory, moves - o.moves, weighted - o.weighted};
  }
  Counts operator/(double n) const { return {all / n, vector_ops / n, memory / n, moves / n, weighted / n}; }
};

// Instructions retired by work() in a forked child, counted by single steps between two
// SIGSTOPs it raises (work ran once before, so that dispatch and page faults are done), each
// classified from its bytes (read before it runs).
Counts steps(const std::function<void()>& work, const char* trace_path = nullptr) {
  const pid_t child = fork();
  if (child == 0) {
    work();
    ptrace(PTRACE_TRACEME, 0, nullptr, nullptr);
    raise(SIGSTOP);
    work();
    raise(SIGSTOP);
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);  // the first SIGSTOP
  Counts c;
  FILE* trace = trace_path != nullptr ? std::fopen(trace_path, "wb") : nullptr;
  for (;;) {
    user_regs_struct regs;
    ptrace(PTRACE_GETREGS, child, nullptr, &regs);
    unsigned char bytes[24];
    for (int k = 0; k < 3; ++k) {
      const long word = ptrace(PTRACE_PEEKTEXT, child, reinterpret_cast<void*>(regs.rip + 8 * k), nullptr);
      std::memcpy(bytes + 8 * k, &word, 8);
    }
    ptrace(PTRACE_SINGLESTEP, child, nullptr, nullptr);
    waitpid(child, &status, 0);
    if (!WIFSTOPPED(status) || WSTOPSIG(status) == SIGSTOP) break;
    c.all += 1;
    if (trace != nullptr) std::fwrite(&regs.rip, sizeof(regs.rip), 1, trace);
    const Encoding encoding = decode(bytes);
    switch (classify(encoding)) {
      case kVectorOp:
        c.vector_ops += 1;
        c.weighted += intel_slots(encoding);
        break;
      case kVectorMemory: c.memory += 1; break;
      case kVectorMove: c.moves += 1; break;
      case kOther: break;
    }
  }
  if (trace != nullptr) std::fclose(trace);
  kill(child, SIGKILL);
  waitpid(child, &status, 0);
  return c;
}

// Per element: work's counts less an empty call's (the raise and the function call).
// With VPCE_COUNT_TRACE=DIR, the addresses of work's instructions in order go to DIR/NAME.rip
// (8 bytes each), for bench/mca_trace.py.
Counts per_element(const std::function<void()>& work, double elements, const std::string& name) {
  static const Counts empty = steps([] {});
  const char* dir = std::getenv("VPCE_COUNT_TRACE");
  const std::string path = dir != nullptr ? std::string(dir) + "/" + name + ".rip" : std::string();
  return (steps(work, dir != nullptr ? path.c_str() : nullptr) - empty) / elements;
}

int run(const char* only) {
  if (const char* dir = std::getenv("VPCE_COUNT_TRACE"); dir != nullptr && access(dir, W_OK) != 0) {
    std::fprintf(stderr, "VPCE_COUNT_TRACE: expected a writable folder, got '%s' (%s)\n", dir, std::strerror(errno));
    return 2;
  }
  constexpr int64_t kCols = kBlockColumns;
  std::vector<float> f32(kCols);
  for (int64_t i = 0; i < kCols; ++i) f32[i] = -8.0f + 16.0f * static_cast<float>((i * 7919) % kCols) / kCols;
  std::vector<BFloat16> bf16(kCols);
  std::vector<Float16> fp16(kCols);
  for (int64_t i = 0; i < kCols; ++i) bf16[i] = from_float<BFloat16>(f32[i]), fp16[i] = from_float<Float16>(f32[i]);
  std::vector<float> grad32(kCols);
  std::vector<float> exp_x(4000), exp_y(4000);
  for (int64_t i = 0; i < 4000; ++i) exp_x[i] = -16.0f * static_cast<float>((i * 97) % 4000) / 4000;
  const TransformParams identity;
  const GradientConstants constants = make_gradient_constants(1.0, 10.0, 1.0, 0.0);
  const void* rows[3] = {f32.data(), bf16.data(), fp16.data()};
  const StorageType types[3] = {StorageType::kFloat32, StorageType::kBFloat16, StorageType::kFloat16};
  const char* names[3] = {"fp32", "bf16", "fp16"};
  std::printf(
      "# per logit (forward = block_stats, backward = block_gradient, 16384 columns) and per element of the "
      "bound's exp (E): all instructions retired / vector operations (VEX or EVEX, not loads, stores or register "
      "moves); predicted %%bound on an exp-bound machine = 2 E / (forward + backward), from vector operations "
      "(pred), and from them weighted by the slots of Intel's 512-bit ports each takes (wpred; bench/port_probe.cc)\n");
  std::printf("# %-6s %5s %13s %13s %13s %13s %8s %8s %8s %8s\n", "target", "dtype", "E", "forward", "bwd to fp32",
              "bwd in place", "pred out", "pred in", "wpred out", "wpred in");
  auto show = [](const Counts& c) {
    static char text[4][32];
    static int next = 0;
    char* t = text[next++ % 4];
    std::snprintf(t, 32, "%6.3f/%6.3f", c.all, c.vector_ops);
    return t;
  };
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    if (only != nullptr && std::strstr(only, hwy::TargetName(target)) == nullptr) continue;
    hwy::SetSupportedTargetsForTest(target);
    const Counts e = per_element([&] { exp_shifted_lanes(exp_x.data(), 0.0f, exp_y.data(), 4000); }, 4000,
                                 std::string(hwy::TargetName(target)) + "-exp");
    for (int k = 0; k < 3; ++k) {
      const StorageType type = types[k];
      const std::string name = std::string(hwy::TargetName(target)) + "-" + names[k];
      const Counts fwd =
          per_element([&] { block_stats(rows[k], type, kCols, identity, false, false); }, kCols, name + "-forward");
      // With label smoothing the forward also sums z - max (scaled): not part of the bound's rows.
      const Counts smoothed = per_element([&] { block_stats(rows[k], type, kCols, identity, true, false); }, kCols,
                                          name + "-forward-smoothed");
      const Counts out = per_element(
          [&] { block_gradient(rows[k], type, grad32.data(), StorageType::kFloat32, kCols, identity, constants); },
          kCols, name + "-to-fp32");
      // In place: in the child's copy of the row.
      const Counts in = per_element(
          [&] { block_gradient(rows[k], type, const_cast<void*>(rows[k]), type, kCols, identity, constants); }, kCols,
          name + "-in-place");
      const char* a = show(e);
      const char* b = show(fwd);
      const char* c = show(out);
      const char* dd = show(in);
      std::printf("  %-6s %5s %13s %13s %13s %13s %7.1f%% %7.1f%% %8.1f%% %7.1f%%\n", hwy::TargetName(target), names[k],
                  a, b, c, dd, 200.0 * e.vector_ops / (fwd.vector_ops + out.vector_ops),
                  200.0 * e.vector_ops / (fwd.vector_ops + in.vector_ops),
                  200.0 * e.weighted / (fwd.weighted + out.weighted),
                  200.0 * e.weighted / (fwd.weighted + in.weighted));
      std::printf("  %-6s %5s %13s   (forward with label smoothing)\n", hwy::TargetName(target), names[k],
                  show(smoothed));
    }
  }
  hwy::SetSupportedTargetsForTest(0);
  return 0;
}

}  // namespace
}  // namespace vpce::detail

// An argument such as "AVX3,AVX2" counts those targets only.
int main(int argc, char** argv) { return vpce::detail::run(argc > 1 ? argv[1] : nullptr); }
