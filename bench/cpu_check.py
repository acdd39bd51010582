#!/usr/bin/env python3
"""bench/cpu_check.py: the figures of one CPU's section of docs/performance.md, in one run, with
the verdict on the loss's bar (every row of both bar commands at 80 % or more of its bound, 0
wrong). For a CPU the project has not measured, or has measured only with older code (an
AVX2-only AMD EPYC for issue 35): run it there after scripts/build.sh, keep the log.

  python3 bench/cpu_check.py [--build build] [--runs 3] [--python build/venv-torch2.15/bin/python]
      [--quick] 2>&1 | tee cpu-check.log

In order (each step's raw output is printed too, for the docs' tables):
  1. the machine: CPU model, family and model, the instruction sets that choose vpce's
     kernels, cores, memory, the commit;
  2. counts: build/bench/vpce_count_instructions on the CPU's best target and AVX2;
  3. ports: build/bench/vpce_port_probe pinned to one core, as slots of the ports the FMAs use,
     12 (t / t_fma - 1) / 4 (bench/port_probe.cc), and from them each pass's slots per logit
     over its instruction trace, weighed by what this CPU measured (a prediction of the
     in-cache ratios; an instruction with no probe counts 1, moves and loads 0);
  4. in cache: bench/exp_bound_in_cache.py (and with --target AVX2 where the CPU's best
     target is AVX-512: that code on this CPU's ports, a proxy, labelled so);
  5. the bar: `vpce perf -b 4096 -e 4096 -V 32000 -t 1 -d all -n 10 -w 2` and `-V 128256 -t 4`,
     --runs times each, alternately; each row's %bound range and median, out of place / in
     place, the limits seen, #wrong;
  6. exactness: GradientUlps (every gradient element against its correct rounding) for the
     CPU's best target and AVX2; with --python, test_gradient_exactness.py against
     megatron-core in that interpreter (its vpce must be this build's: scripts/python-test.sh
     installs it into build/venv-torch2.15).
The exit status is 1 where a row's median is under 80 %, an element is wrong or a test fails.
"""
import argparse
import collections
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mca_trace  # noqa: E402  (the traces' disassembly)

BAR_COMMANDS = (("32000", "1"), ("128256", "4"))
BAR_PERCENT = 80.0
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile")


def run(command, env=None, check=True):
    print(f"$ {' '.join(command)}", flush=True)
    r = subprocess.run(command, capture_output=True, text=True, env=env)
    if check and r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(command)}\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return r


def machine(root):
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    with open("/proc/meminfo") as f:
        memory = int(f.readline().split()[1]) / 2**20
    flags = set(info.get("flags", "").split())
    commit = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}")
    print(f"# cpu: {info.get('model name')}, family {info.get('cpu family')} model {info.get('model')}, "
          f"{os.cpu_count()} cpus, {memory:.0f} GiB; {' '.join(f for f in FLAGS if f in flags)}; "
          f"hypervisor: {'yes' if 'hypervisor' in flags else 'no'}")
    return flags


def counts(build, trace_dir, targets):
    r = run([f"{build}/bench/vpce_count_instructions", ",".join(targets)],
            env=dict(os.environ, VPCE_COUNT_TRACE=trace_dir))
    print(r.stdout, end="")


def port_slots(build):
    """Probe name -> slots of the FMA ports, from the medians of one pinned run."""
    r = run(["taskset", "-c", "1", f"{build}/bench/vpce_port_probe", "--benchmark_repetitions=5",
             "--benchmark_enable_random_interleaving=true", "--benchmark_min_time=0.1",
             "--benchmark_report_aggregates_only=true"])
    medians = {}  # name -> (index, time): the zmm probes come before fma_ymm, the ymm ones from it
    for line in r.stdout.splitlines():
        m = re.match(r"BM_Probe/(\d+)_median\s+([\d.]+) ns.*\s(\S+)$", line)
        if m:
            medians[m.group(3)] = (int(m.group(1)), float(m.group(2)))
    if "fma" not in medians and "fma_ymm" not in medians:
        sys.exit(f"no yardstick (fma, fma_ymm) in the port probe's output:\n{r.stdout[-2000:]}")
    slots = {}
    first_ymm = medians.get("fma_ymm", (1 << 30, 0))[0]
    for name, (index, t) in sorted(medians.items(), key=lambda item: item[1][0]):
        yardstick = medians.get("fma_ymm" if index >= first_ymm else "fma")
        if yardstick and name not in ("fma", "fma_ymm"):
            slots[name] = max(0.0, 12 * (t / yardstick[1] - 1) / 4)  # (noise puts some a little below 0)
    print("# ports: slots of the FMA ports per instruction, 12 (t / t_fma - 1) / 4 (vmulps: the check, 1)")
    for check in ("vmulps", "vmulps_ymm"):
        if check in slots and not 0.8 <= slots[check] <= 1.2:
            print(f"# warning: {check} took {slots[check]:.2f} slots where it takes 1: the probe ran on a busy core")
    for name, s in slots.items():
        print(f"  {name:<20} {s:5.2f}")
    return slots


# Mnemonic (AT&T, suffix-free) -> the probe that stands for it, by register width.
PROBE_OF = {
    "vmulps": "vmulps", "vaddps": "vaddps", "vsubps": "vaddps", "vaddpd": "vaddps",
    "vpslld": "vpslld", "vpsrld": "vpslld", "vpsrad": "vpslld", "vpsrlw": "vpslld",
    "vpand": "vpand", "vpandn": "vpand", "vpor": "vpand", "vpxor": "vpand", "vandps": "vpand", "vorps": "vpand",
    "vandnps": "vpand", "vxorps": "vpand", "vpandd": "vpand", "vpandq": "vpand", "vpord": "vpand", "vporq": "vpand",
    "vpxord": "vpand", "vpxorq": "vpand", "vpaddd": "vpaddd", "vpsubd": "vpaddd", "vpaddw": "vpaddd",
    "vblendvps": "vblendvps", "vroundps": "vroundps", "vcvtps2dq": "vcvtps2dq", "vcvttps2dq": "vcvtps2dq",
    "vpackusdw": "vpackusdw",
    "vpermq": "vpermq", "vpermd": "vpermq", "vpermps": "vpermq", "vmaxps": "vmaxps", "vminps": "vmaxps",
    "vpmaxuw": "vpmaxuw", "vpminuw": "vpmaxuw", "vpmaxsw": "vpmaxsw", "vpminsw": "vpmaxsw",
    "vpblendw": "vpblendw", "vpblendd": "vpblendw", "vpsubusw": "vpsubusw", "vptest": "vptest",
    "vpmovzxwd": "vpmovzxwd", "vscalefps": "vscalefps", "vcvtneps2bf16": "vcvtneps2bf16",
    "vcvtne2ps2bf16": "vcvtne2ps2bf16", "vpermw": "vpermw", "vpternlogd": "vpternlogd",
    "vpternlogq": "vpternlogd", "vmovmskps": "vmovmskps",
}
# Register moves and loads: no slot (VMOVMSKPS is an operation; a broadcast from a register and
# an insertion, shuffles, count 1 for want of a probe).
MOVES = re.compile(r"^v(mov(?!msk)|zeroupper)")
LOADS = re.compile(r"^vp?broadcast\S*\s+[^%]*\(")


def instruction_slots(text, slots, unknown, weight):
    mnemonic = text.split()[0]
    if not mnemonic.startswith("v") or MOVES.match(mnemonic) or LOADS.match(text):
        return 0.0
    if re.match(r"^vf(n?)m(add|sub)", mnemonic):
        return 1.0
    if mnemonic.startswith("vcmp"):
        mnemonic = "vcmpps"
    zmm = "%zmm" in text
    if mnemonic in ("vcvtph2ps", "vcvtps2ph"):
        name = (f"{mnemonic}_m256" if "(" in text else f"{mnemonic}_ymm") if zmm else \
            ("vcvtph2ps_xmm_ymm" if mnemonic == "vcvtph2ps" else "vcvtps2ph_ymm_xmm")
    else:
        base = "vcmpps" if mnemonic == "vcmpps" else PROBE_OF.get(mnemonic)
        name = base and (base if zmm else f"{base}_ymm")
    if name in slots:
        return slots[name]
    unknown[mnemonic] += weight
    return 1.0


def weighed(build, trace_dir, slots):
    table = mca_trace.disassembly(f"{build}/bench/vpce_count_instructions")
    per = {}
    unknown = collections.defaultdict(collections.Counter)  # target -> mnemonic -> per logit, summed over passes
    for file in sorted(os.listdir(trace_dir)):
        target, _, key = file[:-4].partition("-")
        lines, outside, total = mca_trace.trace_text(os.path.join(trace_dir, file), table)
        if outside > total // 20:
            sys.exit(f"{file}: {outside} of {total} addresses are not in vpce_count_instructions (linked -no-pie?)")
        elements = mca_trace.ELEMENTS.get(key, mca_trace.DEFAULT_ELEMENTS)
        per[(target, key)] = sum(instruction_slots(t, slots, unknown[target], 1 / elements) for t in lines) / elements
    print("# each pass's FMA-port slots per logit (the exp: per element), weighed by this CPU's probes; "
          "pred: 2 E / (forward + backward)")
    print(f"# {'target':<6} {'dtype':<5} {'exp':>6} {'forward':>8} {'to fp32':>8} {'in place':>8} "
          f"{'pred out':>8} {'pred in':>8}")
    for target in sorted({t for t, _ in per}):
        for dtype in ("fp32", "bf16", "fp16"):
            e, f = per.get((target, "exp")), per.get((target, f"{dtype}-forward"))
            o, i = per.get((target, f"{dtype}-to-fp32")), per.get((target, f"{dtype}-in-place"))
            if None in (e, f, o, i) or min(f + o, f + i) == 0:
                continue
            print(f"  {target:<6} {dtype:<5} {e:6.3f} {f:8.3f} {o:8.3f} {i:8.3f} {200 * e / (f + o):7.1f}% "
                  f"{200 * e / (f + i):7.1f}%")
    for target, mnemonics in sorted(unknown.items()):
        common = [f"{m} {n:.2f}" for m, n in mnemonics.most_common() if n >= 0.05]
        if common:
            print(f"# {target}: counted as 1 slot (no probe), per logit summed over the passes: " + ", ".join(common))


def in_cache(root, build, runs, targets):
    for target in targets:
        command = [sys.executable, f"{root}/bench/exp_bound_in_cache.py", "--bench",
                   f"{build}/bench/vpce_kernels_bench", "--runs", str(runs), "--repetitions", "10", "--best"]
        if target:
            command += ["--target", target]
        print(run(command).stdout, end="")


def parse_rows(text):
    rows = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 16 and f[3] in ("fp32", "bf16", "fp16") and not line.startswith("#"):
            rows[f[3]] = dict(out=float(f[7]), out_limit=f[8], out_wrong=f[9], inn=float(f[13]),
                              in_limit=f[14], in_wrong=f[15])
    return rows


def bar(build, runs, extra, note=""):
    results = collections.defaultdict(list)
    for k in range(runs):
        for vocab, ranks in BAR_COMMANDS:
            command = [f"{build}/tools/vpce", "perf", "-b", "4096", "-e", "4096", "-V", vocab, "-t", ranks, "-d",
                       "all", "-n", "10", "-w", "2"] + extra
            r = run(command)
            print(f"# run {k + 1} of {runs}, finished {datetime.datetime.now(datetime.timezone.utc):%H:%M:%S} UTC")
            print("\n".join(line for line in r.stdout.splitlines() if not line.startswith("# the copy")))
            rows = parse_rows(r.stdout)
            if sorted(rows) != ["bf16", "fp16", "fp32"]:  # (a changed layout must not pass as met)
                sys.exit(f"expected a row per dtype (fp32, bf16, fp16) from {' '.join(command)}, got {sorted(rows)}")
            for dtype, row in rows.items():
                results[(vocab, ranks, dtype)].append(row)
    met = True
    label = f" ({' '.join(extra)}: a proxy, not the bar)" if extra else ""
    print(f"# the bar{label}: %bound over {runs} runs, range (median), out of place / in place; limits; #wrong")
    for (vocab, ranks, dtype), rows in results.items():
        cells = []
        for side in ("out", "inn"):
            values = [r[side] for r in rows]
            median = statistics.median(values)
            met &= median >= BAR_PERCENT
            cells.append(f"{min(values):.1f}-{max(values):.1f} ({median:.1f})")
        limits = sorted({r["out_limit"] for r in rows} | {r["in_limit"] for r in rows})
        wrong = sorted({r["out_wrong"] for r in rows} | {r["in_wrong"] for r in rows})
        met &= wrong == ["0"]
        print(f"  V {vocab:>6}, R {ranks}  {dtype}  {cells[0]:>22} / {cells[1]:>22}  {','.join(limits):<12} "
              f"wrong {','.join(wrong)}")
    met &= len(results) == 3 * len(BAR_COMMANDS)
    print(f"# every row's median at {BAR_PERCENT:.0f} % or more, 0 wrong: {'met' if met else 'NOT met'}{note}")
    return met


def exactness(build, targets, python, root):
    r = run([f"{build}/tests/vpce_tests", "--gtest_filter=GradientUlps.*"], check=False)
    seen = set()
    for line in r.stdout.splitlines():
        name = line.split("  ")[0].strip()
        if name in targets:
            seen.add(name)
            print(line)
    passed = r.returncode == 0 and seen == set(targets)  # (a filter that matched nothing passes too)
    print(f"# GradientUlps: {'passed' if passed else 'FAILED'}")
    if python:
        test = f"{root}/bindings/python/tests/test_gradient_exactness.py"
        t = run([python, "-m", "pytest", "-q", "-s", "-rs", test], check=False)
        print("\n".join(line for line in t.stdout.splitlines() if line.strip()))
        ran = re.search(r"(\d+) passed", t.stdout) and "skipped" not in t.stdout  # (no megatron-core: all skipped)
        passed &= t.returncode == 0 and bool(ran)
    return passed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--runs", type=int, default=3, choices=range(1, 101), metavar="1..100",
                   help="runs of each bar command (default 3)")
    p.add_argument("--python", help="an interpreter with this build's vpce, torch and megatron-core")
    p.add_argument("--quick", action="store_true", help="one run of everything (a check of the script)")
    a = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = 1 if a.quick else a.runs
    flags = machine(root)
    # The x86 targets whose instructions the counts and probes know (VEX and EVEX): the CPU's best
    # and AVX2; a CPU without AVX2 has neither, and gets the rest.
    native = "AVX3" if {"avx512f", "avx512bw"} <= flags else "AVX2" if {"avx2", "fma"} <= flags else None
    targets = [native, "AVX2"] if native == "AVX3" else [native] if native else []
    if targets:
        with tempfile.TemporaryDirectory() as trace_dir:
            counts(a.build, trace_dir, targets)
            weighed(a.build, trace_dir, port_slots(a.build))
    in_cache(root, a.build, 1 if a.quick else 2, [None] + (["AVX2"] if native == "AVX3" else []))
    met = bar(a.build, runs, [], " (--quick: one run, a check of the script, not the bar)" if a.quick else "")
    if native == "AVX3" and not a.quick:
        bar(a.build, 1, ["--simd-target", "AVX2"])  # the AVX2 code here: a proxy, not the bar
    passed = exactness(a.build, targets, a.python, root)
    sys.exit(0 if met and passed else 1)


if __name__ == "__main__":
    main()
