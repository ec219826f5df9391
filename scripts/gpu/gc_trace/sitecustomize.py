"""Device-call experiments only: with this folder on PYTHONPATH, every Python process
(server, engine core, benchmark client) prints each garbage collection that pauses it
for 20 ms or more to stderr: wall-clock time, generation, pause, process."""

import gc
import os
import sys
import time

_start = [0.0]


def _trace(phase: str, info: dict) -> None:
    if phase == "start":
        _start[0] = time.perf_counter()
        return
    pause = time.perf_counter() - _start[0]
    if pause >= 0.02:
        print(f"GC-TRACE {time.time():.3f} gen{info['generation']} pause {pause * 1000:.1f} ms "
              f"pid {os.getpid()} {os.path.basename(sys.argv[0]) if sys.argv else '?'} "
              f"{' '.join(sys.argv[1:3]) if len(sys.argv) > 1 else ''}", file=sys.stderr, flush=True)


gc.callbacks.append(_trace)
