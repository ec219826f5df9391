"""Read `bench serve --save-detailed` JSON files for what made their TTFT tail: stalls that
hit every stream at once (an ITL gap of over --gap-ms shared by several streams, with the
tokens the server made meanwhile arriving together after it) and bursts of arrivals.

    python scripts/gpu/serve_stalls.py run1.json run2.json [--plot out.png] [--summary out.json]

Prints one line per run; --plot draws TTFT against arrival time per run, with the stalls
marked; --summary writes the per-run figures (no per-request detail) as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def stalls(run: dict, gap_s: float) -> list[dict]:
    """Clusters (within 0.3 s) of ITL gaps over gap_s: start (s into the run), longest gap
    (ms), streams hit, and how many tokens came back to back (< 1 ms) right after."""
    t0 = min(run["start_times"])
    events = []
    for start, ttft, itls in zip(run["start_times"], run["ttfts"], run["itls"]):
        t = start + ttft
        for k, gap in enumerate(itls):
            if gap > gap_s:
                after = 0
                for g in itls[k + 1 :]:
                    if g >= 0.001:
                        break
                    after += 1
                events.append((t - t0, gap, after))
            t += gap
    events.sort()
    out: list[dict] = []
    for at, gap, after in events:
        if out and at - out[-1]["at_s"] < 0.3:
            c = out[-1]
            c["streams"] += 1
            c["max_gap_ms"] = max(c["max_gap_ms"], gap * 1000)
            c["max_back_to_back"] = max(c["max_back_to_back"], after)
        else:
            out.append({"at_s": round(at, 3), "max_gap_ms": gap * 1000, "streams": 1, "max_back_to_back": after})
    return out


def worst(run: dict, n: int = 5, window_s: float = 0.15) -> list[dict]:
    """The n slowest first tokens: when they arrived and how many requests arrived in the
    window before them."""
    starts, ttfts = run["start_times"], run["ttfts"]
    t0 = min(starts)
    order = sorted(range(len(ttfts)), key=lambda i: -ttfts[i])[:n]
    return [
        {
            "at_s": round(starts[i] - t0, 3),
            "ttft_ms": round(ttfts[i] * 1000, 1),
            "arrived_before": sum(1 for s in starts if 0 < starts[i] - s <= window_s),
        }
        for i in order
    ]


def summarize(path: Path, gap_s: float) -> dict:
    run = json.loads(path.read_text())
    if "ttfts" not in run:
        raise SystemExit(f"{path}: no per-request detail (run bench serve with --save-detailed)")
    return {
        "run": path.stem,
        "seed": run.get("seed"),
        "p99_ttft_ms": run["p99_ttft_ms"],
        "mean_ttft_ms": run["mean_ttft_ms"],
        "p99_tpot_ms": run["p99_tpot_ms"],
        "stalls": stalls(run, gap_s),
        "worst_ttft": worst(run),
    }


def plot(paths: list[Path], summaries: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(paths), 1, figsize=(11, 2.6 * len(paths)), sharex=True, squeeze=False)
    for ax, path, s in zip(axes[:, 0], paths, summaries):
        run = json.loads(path.read_text())
        t0 = min(run["start_times"])
        ax.scatter([x - t0 for x in run["start_times"]], [x * 1000 for x in run["ttfts"]], s=6)
        for st in s["stalls"]:
            ax.axvspan(st["at_s"], st["at_s"] + st["max_gap_ms"] / 1000, color="red", alpha=0.3)
        ax.axhline(99, color="gray", lw=0.8, ls="--")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{s['run']}: TTFT p99 {s['p99_ttft_ms']:.1f} ms; red: stalls of every stream", fontsize=9)
    axes[-1, 0].set_xlabel("arrival (s into the run)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--gap-ms", type=float, default=60.0, help="an ITL gap over this is a stall candidate")
    p.add_argument("--plot", type=Path)
    p.add_argument("--summary", type=Path)
    args = p.parse_args()
    summaries = [summarize(path, args.gap_ms / 1000) for path in args.runs]
    for s in summaries:
        st = ", ".join(f"{x['max_gap_ms']:.0f} ms at {x['at_s']:.1f} s ({x['streams']} streams)" for x in s["stalls"]
                       if x["streams"] >= 3) or "none"  # fmt: skip
        print(
            f"{s['run']}: TTFT p99 {s['p99_ttft_ms']:.1f} ms, mean {s['mean_ttft_ms']:.1f}; TPOT p99 "
            f"{s['p99_tpot_ms']:.2f} ms; stalls: {st}; slowest first tokens: "
            + ", ".join(
                f"{w['ttft_ms']:.0f} ms ({w['arrived_before']} arrived 150 ms before)" for w in s["worst_ttft"][:3]
            )
        )
    if args.plot:
        plot(args.runs, summaries, args.plot)
    if args.summary:
        args.summary.write_text(json.dumps(summaries, indent=1) + "\n")


if __name__ == "__main__":
    main()
