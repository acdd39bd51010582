"""bench/process_memory.py: this process's resident memory, from Linux's /proc/self, for the
benchmarks that report what a call held at its peak (compare.py, head_compare.py,
rl_compare.py, rl_head_memory.py, gpt_step_memory.py)."""


def status_mib(field):
    """VmRSS (resident now) or VmHWM (the peak since the last reset_peak) of this process
    image, in MiB. (getrusage's ru_maxrss would include the parent's peak, which Linux keeps
    across exec.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak():
    """Starts VmHWM again from the current resident memory (Linux: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
