"""PNG plots of a serving benchmark: latency over time, and the inter-token latency spread.

Uses matplotlib's Figure and Agg canvas directly (no pyplot), so plotting never needs a
display and never changes global matplotlib state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llmserve.bench.serve_client import RequestResult


def new_figure(width: float, height: float):
    """A matplotlib Figure on the Agg canvas (no pyplot, no display)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from exc
    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig, path: str | Path, title: str) -> None:
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")


def plot_serve(results: Sequence[RequestResult], path: str | Path, title: str) -> None:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    fig = new_figure(16, 4.8)
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

    save_figure(fig, path, title)


def plot_multiturn(turns: Sequence[tuple[int, RequestResult]], path: str | Path, title: str) -> None:
    """`bench multiturn`: each turn's TTFT by its index in the conversation (p50 and p99 per
    index drawn over the points), and against its prompt's length."""
    ok = [(t, r) for t, r in turns if r.success]
    fig = new_figure(13, 4.8)
    by_turn, by_len = fig.subplots(1, 2)
    rng = np.random.default_rng(0)
    index = np.array([t for t, _ in ok], dtype=np.float64)
    ttft_ms = np.array([r.ttft * 1000 for _, r in ok])
    by_turn.scatter(index + rng.uniform(-0.15, 0.15, index.size), ttft_ms, s=10, alpha=0.5, label="a turn")
    seen = sorted(set(index.tolist()))
    for q, style in ((50, "-o"), (99, "--s")):
        line = [float(np.percentile(ttft_ms[index == i], q)) for i in seen]
        by_turn.plot(seen, line, style, c="black" if q == 50 else "red", label=f"p{q}")
    by_turn.set(title="TTFT by turn", xlabel="turn (0: the first)", ylabel="TTFT (ms)", xticks=seen)
    by_turn.legend(loc="upper left")
    dots = by_len.scatter([r.prompt_len for _, r in ok], ttft_ms, c=index, s=10, cmap="viridis")
    fig.colorbar(dots, ax=by_len, label="turn")
    by_len.set(title="TTFT by prompt length", xlabel="prompt tokens (the whole history)", ylabel="TTFT (ms)")
    for ax in (by_turn, by_len):
        ax.grid(alpha=0.3)
    save_figure(fig, path, title)
