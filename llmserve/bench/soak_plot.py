"""The PNG of a soak run: every window's figures over time (matplotlib's Agg canvas, no pyplot)."""

from __future__ import annotations

from pathlib import Path


def plot_soak(result: dict, path: str | Path) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from exc

    windows = result["windows"]
    minutes = [w["start_s"] / 60 for w in windows]
    fig = Figure(figsize=(15, 9), layout="constrained")
    (slo, ttft), (rss, other) = fig.subplots(2, 2)

    slo.plot(minutes, [w["slo_attainment"] for w in windows], marker="o", label="SLO attainment")
    slo.set(ylim=(0, 1.05), ylabel="fraction of requests", xlabel="minutes")
    twin = slo.twinx()
    twin.bar(minutes, [sum(w["errors"].values()) for w in windows], width=0.3 * _step(minutes), color="red",
             alpha=0.5, label="errors")  # fmt: skip
    twin.bar(minutes, [w["shed"] for w in windows], width=0.3 * _step(minutes), bottom=[sum(w["errors"].values())
             for w in windows], color="orange", alpha=0.5, label="shed")  # fmt: skip
    twin.set(ylabel="requests")
    slo.set_title("SLO attainment; errors and shed load per window")
    slo.legend(loc="lower left")
    twin.legend(loc="lower right")

    for key, label in (("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99")):
        ttft.plot(minutes, [w[key] for w in windows], marker=".", label=f"TTFT {label}")
    ttft.set(title="Time to first token (streamed requests)", ylabel="ms", xlabel="minutes")
    ttft.legend()

    for proc in sorted({p for w in windows for p in w["rss_mb"]}):
        rss.plot(minutes, [w["rss_mb"].get(proc) for w in windows], label=proc[:40])
    rss.set(title="Resident memory per process", ylabel="MiB", xlabel="minutes")
    if any(w["rss_mb"] for w in windows):
        rss.legend(fontsize="small")

    other.plot(minutes, [sum(w["open_files"].values()) for w in windows], label="open files (all processes)")
    other.set(title="Open files; server queue", xlabel="minutes")
    for key in ("running", "waiting"):
        if any(key in w["server"] for w in windows):
            other.plot(minutes, [w["server"].get(key) for w in windows], label=f"requests {key}")
    other.legend()
    for ax in (slo, ttft, rss, other):
        ax.grid(alpha=0.3)
    fig.suptitle(f"llmserve bench soak: {result['config']['base_url']} at {result['config']['rate']} req/s")
    fig.savefig(path, dpi=90)


def _step(xs: list[float]) -> float:
    return (xs[1] - xs[0]) if len(xs) > 1 else 1.0
