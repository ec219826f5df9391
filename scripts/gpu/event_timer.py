"""Median time of a GPU call by CUDA events, eagerly (host launch costs included): for the
device-call scripts' kernel timings (logprobs_micro.py, fresh_prefill_micro.py, pdl_chain_micro.py)."""

from __future__ import annotations

import torch


def median_ms(fn, iters: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
