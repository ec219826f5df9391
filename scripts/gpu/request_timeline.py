"""Where each request's first token spent its time: joins `bench serve --save-detailed`
runs (the client's view) with the server's `--request-timing-log` (its own wall-clock
times, same host) by the response id, and splits the client's TTFT into

    to_server   client sent -> the HTTP handler took it (connection, HTTP parsing)
    to_stream   handler -> the API process sent it to the core (tokenization, the stream's start)
    to_core     sent -> the core process read it (IPC)
    queue       core read it -> first scheduled (the core's loop, the scheduler)
    prefill     first scheduled -> the core finished the step with its first token
    to_api      core -> the API process had the token (IPC, the API's event loop)
    to_client   API had it -> the client read the chunk (SSE formatting, HTTP)

    python scripts/gpu/request_timeline.py timing.jsonl run1.json [run2.json ...] [--steps steps.jsonl]
        [--plot out.png] [--json out.json]

Prints each phase's p50/p90/p99/max over all joined requests, then the slowest first
tokens phase by phase; with the engine's --step-timing-log (--steps), also what ran while
each of them waited: steps launched between the core reading it and its first step (how
many, how many with prefill tokens) and the first step's size (requests, tokens, prefill).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PHASES = (("to_server", None, "arrival_time"), ("to_stream", "arrival_time", "sent_time"),
          ("to_core", "sent_time", "queued_time"),
          ("queue", "queued_time", "first_scheduled_time"), ("prefill", "first_scheduled_time", "first_token_core_time"),
          ("to_api", "first_token_core_time", "first_token_time"), ("to_client", "first_token_time", None))  # fmt: skip


def read_log(path: Path) -> dict[str, dict]:
    """The timing log by request id; a completion's prompt i is logged as `<id>-<i>`, so
    each is filed under the response id too when it is the first prompt."""
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["request_id"]] = rec
            if rec["request_id"].endswith("-0"):
                records.setdefault(rec["request_id"][:-2], rec)
    return records


def join(run: dict, records: dict[str, dict]) -> list[dict]:
    """One row per successful client request found in the log: its phases in ms."""
    if "response_ids" not in run:
        raise SystemExit("the run has no per-request ids (bench serve --save-detailed, from this version on)")
    rows = []
    for i, (rid, sent, ttft, err) in enumerate(zip(run["response_ids"], run["sent_wall_times"], run["ttfts"],
                                                   run["errors"])):  # fmt: skip
        rec = records.get(rid)
        if err or rec is None or any(rec.get(k) is None for _, a, b in PHASES for k in (a, b) if k):
            continue
        times = {"sent": sent, **rec, "client_first_token": sent + ttft}
        row = {"index": i, "request_id": rid, "at_s": sent - min(run["sent_wall_times"]), "ttft_ms": ttft * 1000}
        for name, a, b in PHASES:
            row[name] = (times[b or "client_first_token"] - times[a or "sent"]) * 1000
        rows.append(row)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [f"{'phase (ms)':<12}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}"]
    for name in [p[0] for p in PHASES] + ["ttft_ms"]:
        v = [r[name] for r in rows]
        lines.append(f"{name:<12}" + "".join(f"{q:9.1f}" for q in np.percentile(v, (50, 90, 99, 100))))
    return lines


def read_steps(path: Path) -> list[dict]:
    return sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()),
                  key=lambda s: s["launch"])  # fmt: skip


def while_waiting(rec: dict, steps: list[dict]) -> str:
    """The steps launched while the request waited in the core, and its first step."""
    queued, scheduled = rec["queued_time"], rec["first_scheduled_time"]
    waited = [s for s in steps if queued <= s["launch"] < scheduled and s["launch"] < s["launched"]]
    first = next((s for s in steps if s["launch"] <= scheduled <= s["launched"]), None)
    text = f"{len(waited)} steps ({sum(1 for s in waited if s['prefill'])} with prefill)"
    if first is not None:
        text += (
            f"; its step: {first['reqs']} reqs, {first['tokens']} tokens ({first['prefill']} prefill), "
            f"{(first['done'] - first['launch']) * 1000:.1f} ms launch to done"
        )
    return text


def slowest(
    rows: list[dict], n: int, records: dict[str, dict] | None = None, steps: list[dict] | None = None
) -> list[str]:
    names = [p[0] for p in PHASES]
    lines = [f"{'run':<5}{'at s':>7}{'ttft':>8}" + "".join(f"{x:>10}" for x in names)]
    for r in sorted(rows, key=lambda r: -r["ttft_ms"])[:n]:
        line = f"{r['run']:<5}{r['at_s']:7.2f}{r['ttft_ms']:8.1f}" + "".join(f"{r[x]:10.1f}" for x in names)
        if steps and records:
            line += "  | " + while_waiting(records[r["request_id"]], steps)
        lines.append(line)
    return lines


def plot(rows: list[dict], out: Path, n: int = 40) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worst = sorted(rows, key=lambda r: -r["ttft_ms"])[:n]
    fig, ax = plt.subplots(figsize=(11, 4))
    bottom = [0.0] * len(worst)
    for name, _, _ in PHASES:
        vals = [max(r[name], 0.0) for r in worst]
        ax.bar(range(len(worst)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(99, color="gray", lw=0.8, ls="--")
    ax.set_xlabel(f"the {len(worst)} slowest first tokens, slowest first")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8, ncol=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="the server's --request-timing-log")
    p.add_argument("runs", nargs="+", type=Path, help="bench serve --save-detailed JSON files")
    p.add_argument("--slowest", type=int, default=15)
    p.add_argument("--steps", type=Path, help="the engine's --step-timing-log")
    p.add_argument("--plot", type=Path)
    p.add_argument("--json", type=Path, help="write the joined rows here")
    args = p.parse_args()
    records = read_log(args.log)
    rows = []
    for k, path in enumerate(args.runs):
        run = json.loads(path.read_text())
        joined = join(run, records)
        print(f"run {k} = {path.name}: {len(joined)} of {len(run['ttfts'])} requests joined")
        rows += [r | {"run": k} for r in joined]
    if not rows:
        raise SystemExit("no request of the runs is in the log")
    print("\n".join(table(rows)))
    print(f"\nthe {min(args.slowest, len(rows))} slowest first tokens:")
    print("\n".join(slowest(rows, args.slowest, records, read_steps(args.steps) if args.steps else None)))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        args.json.write_text(json.dumps(rows) + "\n")


if __name__ == "__main__":
    main()
