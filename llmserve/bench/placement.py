"""`llmserve bench placement`: the placement policies side by side on simulated traffic.

Seven models (two 8B, two 3B, two 1B and one 14B Llama shape, bf16, 4 GiB of KV each) share
a budget of 60 % of their weights. Four traces (Zipf popularity; with bursts; with a
diurnal drift; all together) run through each policy, and through a static placement that
keeps the most requested models that fit and refuses the rest. Wake and sleep times come
from a cost table: `measured` (the H200's seven-model run with sleep mode's arenas),
`no_arenas` (the first H200 measurement, before the arenas: graphs captured again on every
wake), `target` (the issue's 1.0 s for the 8B shape, scaled by size), or a JSON file. The report is a table, a JSON file and a PNG.

    llmserve bench placement --output-json placement.json --plot placement.png
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from llmserve.placement.footprint import Footprint
from llmserve.placement.policies import make_policy
from llmserve.placement.simulator import GIB, SimModel, TraceSpec, make_trace, simulate, simulate_static

# name: (weight GiB, first-token seconds when resident, seconds a request holds the model)
SHAPES = {
    "llama-8b-a": (14.96, 0.08, 3.0), "llama-8b-b": (14.96, 0.08, 3.0),
    "llama-3b-a": (5.98, 0.05, 2.0), "llama-3b-b": (5.98, 0.05, 2.0),
    "llama-1b-a": (2.79, 0.03, 1.5), "llama-1b-b": (2.79, 0.03, 1.5),
    "llama-14b": (27.5, 0.14, 4.5),
}  # fmt: skip
KV_GIB = 4.0
BUDGET_SHARE = 0.6  # of the weights together
POLICIES = ("lru", "lru_prewarm", "q_learning", "demand")


def _costs(kind: str, weight_gib: float) -> tuple[float, float]:
    """(wake seconds, sleep seconds) of a model with these weights, level 1."""
    if kind == "measured":
        # H200, sleep mode's arenas, the seven-model run of 2026-12-01 (docs/history/benchmarks.md):
        # median wakes 0.085 s (1B, 2.79 GiB) to 0.69 s (14B, 27.5 GiB), sleeps 0.12 to
        # 0.59 s; other sizes on the line through them (8B: 0.38 s, measured 0.38-0.43 s)
        return 0.017 + 0.0245 * weight_gib, 0.067 + 0.019 * weight_gib
    if kind == "no_arenas":
        # H200, the first measurement (weights copied tensor by tensor, graphs captured again):
        # 1B woke in 2.48 s and slept in 4.84 s, 8B in 5.33 s and 25.7 s
        return 1.83 + 0.234 * weight_gib, max(0.5, 0.06 + 1.714 * weight_gib)
    if kind == "target":  # the 1.0 s for the 8B shape, scaled by size; sleeps at the same rate
        return 0.2 + 0.055 * weight_gib, 0.1 + 0.03 * weight_gib
    raise ValueError(f"unknown cost table {kind!r}")


def sim_models(costs: str) -> list[SimModel]:
    table = json.loads(Path(costs).read_text()) if costs.endswith(".json") else None
    models = []
    for name, (weights, ttft, service) in SHAPES.items():
        if table is not None:
            if name not in table:
                raise ValueError(f"{costs} has no row for {name}")
            wake, sleep = float(table[name]["wake_s"]), float(table[name]["sleep_s"])
        else:
            wake, sleep = _costs(costs, weights)
        footprint = Footprint(int(weights * GIB), int(KV_GIB * GIB))
        models.append(SimModel(name, footprint, round(wake, 3), round(sleep, 3), ttft, service))
    return models


def traces(duration_s: float, rate: float) -> list[TraceSpec]:
    return [
        TraceSpec("zipf", duration_s, rate),
        TraceSpec("bursts", duration_s, rate, bursts=True),
        TraceSpec("diurnal", duration_s, rate, diurnal=True, period_s=duration_s),
        TraceSpec("mixed", duration_s, rate, bursts=True, diurnal=True, period_s=duration_s),
    ]


DRAIN_AFTER_S = 5.0  # the platform's default (gateway placement.drain_after_s)


def run_all(costs: str, duration_s: float, rate: float, slo_ttft_s: float, seed: int = 0,
            drain_after_s: float | None = DRAIN_AFTER_S) -> list[dict]:  # fmt: skip
    models = sim_models(costs)
    names = [m.name for m in models]
    budget = int(BUDGET_SHARE * sum(m.footprint.weight_bytes for m in models))
    rows = []
    for spec in traces(duration_s, rate):
        trace = make_trace(spec, names, seed)
        rows.append(
            asdict(simulate_static(models, budget, trace, spec.name, duration_s, slo_ttft_s)) | {"costs": costs}
        )
        for name in POLICIES:
            policy = make_policy(name, **({"slo_ttft_s": slo_ttft_s} if name == "demand" else {}))
            if name == "q_learning":  # it starts from one earlier trace's learning (another seed)
                simulate(models, budget, policy, make_trace(spec, names, seed + 100), spec.name, duration_s, slo_ttft_s,
                         drain_after_s=drain_after_s)  # fmt: skip
            result = simulate(
                models, budget, policy, trace, spec.name, duration_s, slo_ttft_s, drain_after_s=drain_after_s
            )
            rows.append(asdict(result) | {"costs": costs})
        print(f"  {costs} costs, trace {spec.name}: {len(trace)} requests simulated", flush=True)
    return rows


def best_policy(rows: list[dict]) -> str:
    """The policy with the highest mean SLO attainment over the traces (fewer wakes breaks a tie)."""

    def score(name: str) -> tuple[float, float]:
        mine = [r for r in rows if r["policy"] == name]
        return (sum(r["slo_attainment"] for r in mine) / len(mine), -sum(r["wakes_per_hour"] for r in mine))

    return max(POLICIES, key=score)


def overall_best(rows: list[dict]) -> str:
    """The policy whose worst mean SLO attainment over the cost tables is highest: the one
    that holds up whatever the wake costs turn out to be (the platform's default)."""
    tables = list(dict.fromkeys(r["costs"] for r in rows))

    def worst(name: str) -> float:
        return min(
            sum(r["slo_attainment"] for r in rows if r["policy"] == name and r["costs"] == c)
            / max(1, sum(1 for r in rows if r["policy"] == name and r["costs"] == c))
            for c in tables
        )

    return max(POLICIES, key=worst)


def table(rows: list[dict]) -> str:
    lines = ["| costs | trace | policy | SLO attained | refused | TTFT mean | TTFT p99 | wakes/h | pre-warms/h | memory mean / peak |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['costs']} | {r['trace']} | {r['policy']} | {r['slo_attainment']:.1%} | {r['refused']} | "
            f"{r['ttft_mean_s']:.2f} s | {r['ttft_p99_s']:.2f} s | {r['wakes_per_hour']:.0f} | "
            f"{r['prewarms_per_hour']:.0f} | {r['memory_mean_frac']:.0%} / {r['memory_peak_frac']:.0%} |"
        )  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict], path: str, slo_ttft_s: float) -> None:
    from matplotlib.figure import Figure

    cost_sets = list(dict.fromkeys(r["costs"] for r in rows))
    trace_names = list(dict.fromkeys(r["trace"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig = Figure(figsize=(13, 4.2 * len(cost_sets)), layout="constrained")
    axes = fig.subplots(len(cost_sets), 2, squeeze=False)
    width = 0.8 / len(policies)
    for row_axes, costs in zip(axes, cost_sets):
        for ax, key, label in ((row_axes[0], "slo_attainment", f"share of requests with TTFT <= {slo_ttft_s:g} s"),
                               (row_axes[1], "wakes_per_hour", "wakes per hour")):  # fmt: skip
            for k, policy in enumerate(policies):
                values = [next(r[key] for r in rows if r["costs"] == costs and r["trace"] == t and r["policy"] == policy)
                          for t in trace_names]  # fmt: skip
                ax.bar([i + k * width for i in range(len(trace_names))], values, width, label=policy)
            ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(trace_names))], trace_names)
            ax.set(title=f"{label} ({costs} wake costs)")
            ax.grid(axis="y", alpha=0.3)
        row_axes[0].set_ylim(0, 1)
        row_axes[0].legend(loc="lower left", fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, format="png")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "placement", help="placement policies on simulated traffic: SLO attainment, wakes, memory"
    )
    p.add_argument("--costs", nargs="+", default=["measured", "no_arenas"],
                   help="wake/sleep cost tables: measured (H200, sleep mode's arenas), no_arenas (H200, the "
                        "first measurement), target (the issue's 1.0 s for 8B), or a JSON file {model: {wake_s, sleep_s}}")  # fmt: skip
    p.add_argument("--duration-s", type=float, default=7200.0, help="simulated seconds of traffic per trace")
    p.add_argument("--rate", type=float, default=1.0, help="requests a second on average (before bursts)")
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="the TTFT target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-after-s", type=float, default=DRAIN_AFTER_S,
                   help="a request waiting this long drains busy models to make room (negative: never)")  # fmt: skip
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="a PNG of SLO attainment and wakes per hour")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    if args.duration_s <= 0 or args.rate <= 0 or args.slo_ttft_s <= 0:
        raise SystemExit("--duration-s, --rate and --slo-ttft-s must be positive")
    start = time.perf_counter()
    rows = []
    for costs in args.costs:
        try:
            drain = args.drain_after_s if args.drain_after_s >= 0 else None
            rows += run_all(costs, args.duration_s, args.rate, args.slo_ttft_s, args.seed, drain)
        except (ValueError, OSError, KeyError) as exc:
            raise SystemExit(f"--costs {costs}: {exc}") from None
    print(table(rows))
    for costs in args.costs:
        print(f"best policy on {costs} costs: {best_policy([r for r in rows if r['costs'] == costs])}")
    print(f"best worst case over the cost tables: {overall_best(rows)}")
    print(f"({time.perf_counter() - start:.1f} s)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot, args.slo_ttft_s)
