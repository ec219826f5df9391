"""`llmserve bench soak`: drive a server for a long time at a steady rate and watch it age.

A client, like `bench serve`: it speaks HTTP to any OpenAI-compatible URL (`llmserve serve`,
`llmserve up`'s gateway, vLLM). The traffic is a mix (`soak_traffic.py`): chat and
completions, streamed and not, short and long prompts, a shared system prompt, and clients
that leave early. Requests arrive at a Poisson rate.

Every window (a minute by default) it records:
- SLO attainment: a streamed request meets the SLO when its TTFT and TPOT are within the
  targets; a whole reply when its latency is within TTFT + TPOT x (tokens - 1);
- errors by kind, with shed load (503, 429) counted apart from failures;
- the resident memory and open files of every process of the platform (the PIDs given
  and their children);
- the server's KV cache usage and queue lengths from `/metrics`.

The summary compares the first and last windows of the run (RSS growth of each process
after the warm-up, p99 TTFT). The JSON holds every window, and a PNG shows all of it over
time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from llmserve.bench.serve import first_model
from llmserve.bench.serve_client import Target, add_target_args
from llmserve.bench.soak_probes import ProcessProbe, scrape_gauges
from llmserve.bench.soak_traffic import Outcome, TrafficMix, send_one


@dataclass
class Window:
    """One window of the run: what was sent in it and what the platform looked like at its end."""

    index: int
    start_s: float
    sent: int = 0
    ok: int = 0
    left: int = 0  # clients that left on purpose (not errors)
    shed: int = 0  # 503 / 429: load the platform refused by design
    shed_kinds: dict[str, int] = field(default_factory=dict)  # status and the server's error code -> count
    errors: dict[str, int] = field(default_factory=dict)  # kind -> count
    error_examples: dict[str, str] = field(default_factory=dict)  # kind -> the first message
    slo_met: int = 0
    slo_judged: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    rss_mb: dict[str, float] = field(default_factory=dict)  # process label -> MiB
    open_files: dict[str, int] = field(default_factory=dict)
    server: dict[str, float] = field(default_factory=dict)  # gauges from /metrics

    @property
    def slo_attainment(self) -> float | None:
        return self.slo_met / self.slo_judged if self.slo_judged else None


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("soak", help="long run at a steady rate: SLO attainment, errors, memory over time")
    add_target_args(p)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds to run")
    p.add_argument("--rate", type=float, required=True, help="requests per second (Poisson arrivals)")
    p.add_argument("--window", type=float, default=60.0, help="seconds per recorded window")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=200.0)
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens a request asks for")
    p.add_argument("--short-words", type=int, default=40, help="words of a short prompt, at most (80 %% of requests)")
    p.add_argument("--long-words", type=int, default=400, help="words of a long prompt, at most (20 %% of requests)")
    p.add_argument(
        "--chat-share",
        type=float,
        default=0.6,
        help="fraction of chat requests (the rest: completions; 0 for a model without a chat template)",
    )
    p.add_argument("--pids", default="", help="comma-separated PIDs of the platform's processes (children included)")
    p.add_argument("--warmup-windows", type=int, default=5, help="windows before memory growth is measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of every window's figures")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if not 0 <= args.chat_share <= 1:
        raise SystemExit("llmserve bench soak: --chat-share must be in [0, 1]")
    if min(args.rate, args.duration, args.window, args.max_tokens, args.short_words, args.long_words) <= 0:
        raise SystemExit(
            "llmserve bench soak: --rate, --duration, --window, --max-tokens and the word counts must be positive"
        )
    pids = [int(p) for p in args.pids.split(",") if p.strip()]
    result = asyncio.run(soak(args, pids))
    print(format_summary(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    if args.plot:
        from llmserve.bench.soak_plot import plot_soak

        plot_soak(result, args.plot)
    return result


async def soak(args: argparse.Namespace, pids: list[int]) -> dict:
    rng = random.Random(args.seed)
    probe = ProcessProbe(pids)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:
        model = args.model or await first_model(client, Target(args.base_url, "/v1/models", None, args.api_key))
        mix = TrafficMix(args.base_url, model, headers, args.max_tokens, args.short_words, args.long_words,
                         args.chat_share)  # fmt: skip
        count = max(1, math.ceil(args.duration / args.window - 1e-9))
        windows = [Window(i, round(i * args.window, 3)) for i in range(count)]
        outcomes: list[tuple[int, Outcome]] = []  # (window index, outcome)
        tasks: set[asyncio.Task] = set()
        current = 0
        arrival = 0.0
        t0 = time.perf_counter()
        while (now := time.perf_counter() - t0) < args.duration:
            while current < min(int(now // args.window), count - 1):  # a window ended: sample the platform
                await _close(windows[current], probe, client, args.base_url, headers)
                current += 1
            if now >= arrival:
                windows[current].sent += 1
                task = asyncio.create_task(send_one(client, mix, mix.draw(rng)))
                task.add_done_callback(lambda t, i=current: outcomes.append((i, t.result())))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                arrival += rng.expovariate(args.rate)
                continue
            await asyncio.sleep(max(0.0, min(arrival, (current + 1) * args.window, args.duration) - now))
        await _close(windows[current], probe, client, args.base_url, headers)
        if tasks:  # requests still in flight count in the window that sent them
            await asyncio.wait(tasks, timeout=300.0)
        _tally(windows, outcomes, args)
    return {"config": {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"},
            "model": model, "windows": [asdict(w) | {"slo_attainment": w.slo_attainment} for w in windows],
            "summary": summarize(windows, args.warmup_windows)}  # fmt: skip


async def _close(window: Window, probe: ProcessProbe, client: httpx.AsyncClient, base_url: str, headers: dict) -> None:
    """The platform's state at the end of `window` (requests are tallied at the end of the run)."""
    window.rss_mb, window.open_files = probe.sample()
    window.server = await scrape_gauges(client, base_url, headers)


def _tally(windows: list[Window], outcomes: list[tuple[int, Outcome]], args: argparse.Namespace) -> None:
    by_window: dict[int, list[Outcome]] = {}
    for index, outcome in outcomes:
        by_window.setdefault(index, []).append(outcome)
    for window in windows:
        ttfts = []
        for o in by_window.get(window.index, []):
            if o.left:
                window.left += 1
            elif o.shed:
                window.shed += 1
                window.shed_kinds[o.error_kind] = window.shed_kinds.get(o.error_kind, 0) + 1
            elif o.error:
                window.errors[o.error_kind] = window.errors.get(o.error_kind, 0) + 1
                window.error_examples.setdefault(o.error_kind, o.error)
            else:
                window.ok += 1
                window.slo_judged += 1
                window.slo_met += o.meets(args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
                if o.ttft is not None:
                    ttfts.append(o.ttft * 1000)
        if ttfts:
            ttfts.sort()
            window.ttft_p50_ms = round(ttfts[len(ttfts) // 2], 1)
            window.ttft_p99_ms = round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1)


def summarize(windows: list[Window], warmup: int) -> dict:
    """Totals, and the drift of memory and TTFT between the first and last windows after the warm-up."""
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for w in windows:
        for kind, n in w.errors.items():
            errors[kind] = errors.get(kind, 0) + n
        for kind, text in w.error_examples.items():
            examples.setdefault(kind, text)
    after = windows[min(warmup, len(windows) - 1) :] if windows else []
    growth = {}
    if after:
        first, last = after[0].rss_mb, after[-1].rss_mb
        growth = {p: round(100 * (last[p] - first[p]) / first[p], 2) for p in first if p in last and first[p] > 0}
    span = max(1, min(warmup, len(windows) // 2))
    p99_first = [w.ttft_p99_ms for w in windows[:span] if w.ttft_p99_ms is not None]
    p99_last = [w.ttft_p99_ms for w in windows[-span:] if w.ttft_p99_ms is not None]
    judged = sum(w.slo_judged for w in windows)
    return {
        "requests": sum(w.sent for w in windows),
        "ok": sum(w.ok for w in windows),
        "left_on_purpose": sum(w.left for w in windows),
        "shed": sum(w.shed for w in windows),
        "errors": errors,
        "error_examples": examples,
        "slo_attainment": round(sum(w.slo_met for w in windows) / judged, 4) if judged else None,
        "slo_attainment_worst_window": min((w.slo_attainment for w in windows if w.slo_judged), default=None),
        "rss_growth_pct_after_warmup": growth,
        "ttft_p99_ms_first": max(p99_first, default=None),
        "ttft_p99_ms_last": max(p99_last, default=None),
    }


def format_summary(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"Soak of {result['config']['base_url']} ({result['model']}): {len(result['windows'])} windows of "
        f"{result['config']['window']:.0f} s at {result['config']['rate']} req/s",
        f"  requests {s['requests']}: ok {s['ok']}, left on purpose {s['left_on_purpose']}, shed {s['shed']}, "
        f"errors {sum(s['errors'].values())} {s['errors'] or ''}",
        f"  SLO attainment {s['slo_attainment']} (worst window {s['slo_attainment_worst_window']})",
        f"  TTFT p99: first windows {s['ttft_p99_ms_first']} ms, last windows {s['ttft_p99_ms_last']} ms",
        f"  RSS growth after the warm-up (%): {s['rss_growth_pct_after_warmup']}",
    ]
    return "\n".join(lines)
