"""PNG plots of a serving benchmark: latency over time, and the inter-token latency spread.

Uses matplotlib's Figure and Agg canvas directly (no pyplot), so plotting never needs a
display and never changes global matplotlib state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llmserve.bench.serve_client import RequestResult


def plot_serve(results: Sequence[RequestResult], path: str | Path, title: str) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from exc

    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    fig = Figure(figsize=(16, 4.8), layout="constrained")
    over_time, hist, cdf = fig.subplots(1, 3)

    starts = [r.start for r in ok]
    over_time.scatter(starts, [r.latency * 1000 for r in ok], s=10, label="E2E latency")
    over_time.scatter(starts, [r.ttft * 1000 for r in ok], s=10, label="TTFT")
    if failed:
        over_time.scatter([r.start for r in failed], [0] * len(failed), s=16, marker="x", c="red", label="failed")
    over_time.set(title="Per-request latency", xlabel="request sent at (s since start)", ylabel="ms")
    over_time.legend(loc="upper left")
    over_time.grid(alpha=0.3)

    itl_ms = np.sort(np.array([g for r in ok for g in r.itl]) * 1000)
    if itl_ms.size:
        hist.hist(itl_ms, bins=min(60, max(10, itl_ms.size // 20)))
        cdf.plot(itl_ms, np.arange(1, itl_ms.size + 1) / itl_ms.size)
        for q in (50, 90, 99):
            x = float(np.percentile(itl_ms, q))
            cdf.axvline(x, ls="--", lw=0.8, c="gray")
            cdf.annotate(f"p{q} {x:.1f}", (x, q / 100), fontsize=8, xytext=(3, -10), textcoords="offset points")
    hist.set(title="Inter-token latency", xlabel="ms", ylabel="gaps")
    cdf.set(title="Inter-token latency CDF", xlabel="ms", ylabel="fraction <= x", ylim=(0, 1.02))
    hist.grid(alpha=0.3)
    cdf.grid(alpha=0.3)

    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
