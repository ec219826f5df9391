"""Independent warm-up launches on a few threads, so their Triton compiles overlap.

A fresh machine's start is mostly compiles: the kernel warm-up is most of it, the 22
paged-attention variants one after another most of that, and with a warm Triton cache it is
under a second (scripts/gpu/startup_phases.py; docs/history/benchmarks.md). A compile's LLVM and ptxas
steps run outside the GIL, so launches that compile different kernels go faster on threads: each
launch is a unit, handed to `submit`; the pool runs units on its threads, each on the pool's
device and in inference mode, and leaving the `with` block waits for them all, then raises the
first error. With one worker (or a CPU device: the Triton interpreter is not thread-safe) a unit
runs at once in the caller's thread, which is the reference the threads must match: the same
launches, in any order, with the same effect (warm-up outputs are thrown away).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

Unit = Callable[[], object]


def default_workers(device: torch.device) -> int:
    """LLMSERVE_WARMUP_THREADS, else up to 8 threads on a GPU (one on a CPU)."""
    configured = os.environ.get("LLMSERVE_WARMUP_THREADS")
    if configured:
        return max(1, int(configured))
    return min(8, os.cpu_count() or 1) if device.type == "cuda" else 1


class WarmupPool:
    def __init__(self, device: torch.device, workers: int | None = None) -> None:
        self.device = device
        self.workers = default_workers(device) if workers is None else max(1, workers)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="warmup") if self.workers > 1 else None
        self._futures: list[Future] = []
        self.busy_s = 0.0  # the units' own time, summed (over the wall time: what the threads overlapped)
        self._lock = threading.Lock()

    def submit(self, unit: Unit) -> Future:
        """Run `unit` now (one worker) or on a thread; its future holds its result."""
        if self._pool is None:
            future: Future = Future()
            try:
                future.set_result(self._run(unit))
            except BaseException as e:  # noqa: BLE001 - kept for `__exit__`, as a thread's would be
                future.set_exception(e)
        else:
            future = self._pool.submit(self._run, unit)
        self._futures.append(future)
        return future

    def _run(self, unit: Unit) -> object:
        start = time.perf_counter()
        try:
            if self.device.type == "cuda":  # a new thread starts on device 0 (a tensor-parallel rank is not)
                with torch.cuda.device(self.device), torch.inference_mode():
                    return unit()
            with torch.inference_mode():
                return unit()
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - start

    def __enter__(self) -> WarmupPool:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        errors = [e for e in (f.exception() for f in self._futures) if e is not None]
        self._futures = []
        if errors and exc[0] is None:
            raise errors[0]
