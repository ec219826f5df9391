"""How long engine steps take on the device, by their prefill tokens, from the engine's
`--step-timing-log`. A step's device time is estimated as done - max(launched, the previous
step's done): with async scheduling a step is launched while the one before it runs, and
the device takes it up when that one is done and its own launch is complete.

    python scripts/gpu/step_times.py steps.jsonl [--split-s 10]

Prints, per prefill-token bucket, the count and the median/p90/max device time, over the
whole log and (with --split-s) over the first S seconds of each busy period against the
rest, to show start-up effects (e.g. work done on a size's first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BUCKETS = ((0, 0), (1, 512), (513, 1024), (1025, 1536), (1537, 2048), (2049, 1 << 30))


def device_times(steps: list[dict]) -> list[dict]:
    """The steps in launch order, each with `device_ms` (see the module doc) and `t`
    (seconds since the first step)."""
    steps = sorted(steps, key=lambda s: s["launch"])
    out, prev_done = [], None
    for s in steps:
        start = s["launched"] if prev_done is None else max(s["launched"], prev_done)
        out.append(s | {"device_ms": (s["done"] - start) * 1000, "t": s["launch"] - steps[0]["launch"]})
        prev_done = s["done"]
    return out


def bucket_of(prefill: int) -> str:
    lo, hi = next((lo, hi) for lo, hi in BUCKETS if lo <= prefill <= hi)
    return "decode only" if hi == 0 else (f"> {lo - 1}" if hi >= 1 << 30 else f"{lo}-{hi}")


def table(steps: list[dict]) -> list[str]:
    groups: dict[str, list[float]] = {}
    for s in steps:
        groups.setdefault(bucket_of(s["prefill"]), []).append(s["device_ms"])
    lines = [f"{'prefill tokens':<16}{'steps':>7}{'median':>9}{'p90':>9}{'max':>9}"]
    for lo, hi in BUCKETS:
        name = bucket_of(lo if hi else 0)
        if v := sorted(groups.get(name, [])):
            p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
            lines.append(f"{name:<16}{len(v):7d}{statistics.median(v):9.1f}{p90:9.1f}{v[-1]:9.1f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path)
    p.add_argument(
        "--split-s", type=float, default=None, help="compare each busy period's first S seconds with the rest"
    )
    p.add_argument("--idle-s", type=float, default=2.0, help="a gap this long between steps starts a new busy period")
    args = p.parse_args()
    steps = device_times([json.loads(line) for line in args.log.read_text().splitlines() if line.strip()])
    print(f"{len(steps)} steps over {steps[-1]['t']:.1f} s")
    print("\n".join(table(steps)))
    if args.split_s is not None:
        early, late, period_start, prev = [], [], None, None
        for s in steps:
            if prev is None or s["launch"] - prev["done"] > args.idle_s:
                period_start = s["launch"]
            (early if s["launch"] - period_start < args.split_s else late).append(s)
            prev = s
        print(f"\nthe first {args.split_s:g} s of each busy period:")
        print("\n".join(table(early)) if early else "(none)")
        print("the rest:")
        print("\n".join(table(late)) if late else "(none)")


if __name__ == "__main__":
    main()
