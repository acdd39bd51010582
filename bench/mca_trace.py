#!/usr/bin/env python3
"""bench/mca_trace.py: cycles per logit of the kernels' passes on CPUs this machine is not,
from the exact instruction traces that bench/count_instructions.cc records, simulated by
llvm-mca's scheduling models (Debian's llvm-19: `apt-get install llvm-19`).

Each trace is the sequence of instructions one pass retired over a 16384-column block (the
bound's exp over 4000 elements), in order; llvm-mca runs it once as one straight block on the
CPU's model (all loads from L1, branches free: the in-cache, arithmetic-bound case). A row's
predicted %bound on an exp-bound machine is then 2 C_exp / (C_forward + C_backward), with C
the cycles per element, as `vpce perf` computes it from time.

  mkdir -p /tmp/trace && VPCE_COUNT_TRACE=/tmp/trace build/bench/vpce_count_instructions AVX3
  python3 bench/mca_trace.py build/bench/vpce_count_instructions /tmp/trace AVX3 znver4 icelake-server
"""
import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile

ELEMENTS = {"exp": 4000}
DEFAULT_ELEMENTS = 16384  # the kernels' block (kBlockColumns)
# Control flow and what llvm-mca cannot place in one straight block.
DROPPED = re.compile(r"^(j\w*|call\w*|ret\w*|syscall|nop\w*|cs nop\w*|data16.*|endbr64|bnd .*|notrack .*|xchg %ax,%ax)\b")


def disassembly(binary):
    """Address -> AT&T text of every instruction in the (non-PIE) binary."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary], capture_output=True, text=True,
                         check=True).stdout
    table = {}
    for line in out.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(\S.*)", line)
        if m:
            table[int(m.group(1), 16)] = re.sub(r"\s*<[^>]*>", "", m.group(2)).split("#")[0].strip()
    return table


def trace_text(path, table):
    with open(path, "rb") as f:
        data = f.read()
    lines, unknown = [], 0
    for (rip,) in struct.iter_unpack("<Q", data):
        text = table.get(rip)
        if text is None:
            unknown += 1  # in a shared library (libc's raise, libhwy's dispatch)
        elif not DROPPED.match(text):
            lines.append(text)
    return lines, unknown, len(data) // 8


def mca_cycles(mca, cpu, lines):
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(lines) + "\n")
        name = f.name
    try:
        r = subprocess.run([mca, "-mtriple=x86_64", f"-mcpu={cpu}", "-iterations=1", name], capture_output=True,
                           text=True)
    finally:
        os.unlink(name)
    m = re.search(r"Total Cycles:\s+(\d+)", r.stdout)
    if not m:
        sys.exit(f"llvm-mca failed on {cpu}: {r.stderr[:2000]}")
    return int(m.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("binary", help="the count_instructions binary that recorded the traces (linked -no-pie)")
    p.add_argument("traces", help="the VPCE_COUNT_TRACE folder")
    p.add_argument("target", help="the Highway target of the traces (AVX3, AVX2)")
    p.add_argument("cpus", nargs="+", help="llvm-mca CPU names (znver4, icelake-server, skylake-avx512, ...)")
    p.add_argument("--mca", default="llvm-mca-19")
    a = p.parse_args()
    table = disassembly(a.binary)
    cycles = {}
    for file in sorted(os.listdir(a.traces)):
        if not (file.startswith(a.target + "-") and file.endswith(".rip")):
            continue
        key = file[len(a.target) + 1:-4]
        lines, unknown, total = trace_text(os.path.join(a.traces, file), table)
        if unknown > total // 20:
            sys.exit(f"{file}: {unknown} of {total} addresses are not in {a.binary} (was it linked -no-pie?)")
        n = ELEMENTS.get(key, DEFAULT_ELEMENTS)
        for cpu in a.cpus:
            cycles[(cpu, key)] = mca_cycles(a.mca, cpu, lines) / n
    print(f"# llvm-mca cycles per element (per logit; the exp per element) of the {a.target} traces, and the "
          "predicted %bound on an exp-bound machine, 2 C_exp / (C_forward + C_backward)")
    print(f"# {'cpu':<16} {'dtype':<5} {'exp':>7} {'forward':>8} {'to fp32':>8} {'in place':>8} "
          f"{'pred out':>8} {'pred in':>8}")
    for cpu in a.cpus:
        for dtype in ("fp32", "bf16", "fp16"):
            e = cycles.get((cpu, "exp"))
            f = cycles.get((cpu, f"{dtype}-forward"))
            o = cycles.get((cpu, f"{dtype}-to-fp32"))
            i = cycles.get((cpu, f"{dtype}-in-place"))
            if None in (e, f, o, i):
                continue
            print(f"  {cpu:<16} {dtype:<5} {e:7.3f} {f:8.3f} {o:8.3f} {i:8.3f} {200 * e / (f + o):7.1f}% "
                  f"{200 * e / (f + i):7.1f}%")


if __name__ == "__main__":
    main()
