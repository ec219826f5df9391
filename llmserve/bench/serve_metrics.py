"""From per-request results to the serving metrics, with vLLM's names and definitions.

Throughputs count successful requests only, over the whole benchmark duration; TPOT
is per request (time after the first token / tokens after the first), ITL is every gap
between token-carrying chunks, E2EL is send -> last byte.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from llmserve.bench.report import summarize
from llmserve.bench.serve_client import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(SLO_METRICS)}; got {item!r}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {value}")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return all(values[k] is None or values[k] * 1000 <= ms for k, ms in slos.items())


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (failed ones too: they held a connection)."""
    # at equal times an end sorts before a start: back-to-back requests do not overlap
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results])
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def peak_output_throughput(results: Sequence[RequestResult]) -> float:
    """Most token chunks that arrived within one whole second of the benchmark."""
    per_second = Counter(math.floor(t) for r in results if r.success for t in r.token_times)
    return float(max(per_second.values(), default=0))


def compute_metrics(
    results: Sequence[RequestResult], duration: float, percentiles: Sequence[float], slos: dict[str, float]
) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    metrics: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": sum(meets_slos(r, slos) for r in ok) / duration if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_output_throughput(results),
        "max_concurrent_requests": peak_concurrency(results),
    }
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in LATENCY_METRICS:
        metrics.update(summarize(samples[name], percentiles, f"{name}_ms", scale=1000.0))
    return metrics
