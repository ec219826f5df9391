"""Times of a GPU call by CUDA events for the device-call scripts' kernel timings: `median_ms`
eagerly (host launch costs included: logprobs_micro.py, fresh_prefill_micro.py, pdl_chain_micro.py),
`graph_time_us` replayed from a CUDA graph as the engine runs decode steps (fp8_gemm_micro.py,
fp8_large_m.py, quant_split_k_micro.py, moe_decode_micro.py)."""

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


def graph_time_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Mean microseconds per call of `fn`, from a CUDA graph of `calls` calls replayed `replays` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)
