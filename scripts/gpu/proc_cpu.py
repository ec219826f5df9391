"""CPU use of each llmserve / Triton process over a window (cores busy), from /proc:
    python3 scripts/gpu/proc_cpu.py SECONDS
Which process of the platform (gateway, tritonserver, the chat model's stub, its engine core)
runs near one full core while a benchmark runs."""

import os
import sys
import time


def sample() -> dict[int, tuple[str, int]]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if any(k in cmd for k in ("llmserve", "triton", "multiprocessing", "python")):
            out[int(pid)] = (cmd, int(fields[11]) + int(fields[12]))  # utime + stime, in ticks
    return out


def main() -> None:
    window = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    before = sample()
    time.sleep(window)
    after = sample()
    hz = os.sysconf("SC_CLK_TCK")
    for pid, (cmd, ticks) in sorted(after.items()):
        if pid in before and (busy := (ticks - before[pid][1]) / hz / window) > 0.01:
            print(f"{pid:7d} {busy:5.2f} cores  {cmd}")


if __name__ == "__main__":
    main()
