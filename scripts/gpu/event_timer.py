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
    """Microseconds per call of `fn`: `calls` calls in a CUDA graph, the median of `replays` replays
    (llmserve.kernels.tune.graph_timer, which `llmserve tune` times the fused MoE's tiles with)."""
    from llmserve.kernels.tune import graph_timer

    return graph_timer(calls, replays)(fn) * 1e6
