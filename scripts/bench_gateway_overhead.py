"""Latency the gateway adds: the same open-loop load sent to a fast fake upstream directly and
through the gateway (one key, limits on, least-outstanding routing), medians compared.

    python scripts/bench_gateway_overhead.py --rate 200 --rounds 3 --duration 10 --out docs/bench_gateway_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import tempfile
import time

import httpx
from gateway_bench_lib import (
    Proc,
    free_port,
    gateway,
    start,
    wait_healthy,
    wait_upstreams_up,
)

KEY = "sk-bench"


async def open_loop(url: str, rate: float, duration: float, headers: dict) -> tuple[list[float], int]:
    """Send at `rate` requests/s (evenly spaced) for `duration` s; latencies of the 200s, errors."""
    body = {"model": "fake", "prompt": "Say something short.", "max_tokens": 4}
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as client:

        async def one() -> None:
            nonlocal errors
            start = time.perf_counter()
            try:
                resp = await client.post("/v1/completions", json=body)
                ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - start)
            else:
                errors += 1

        for _ in range(20):  # warm the connections
            await one()
        latencies.clear()
        tasks = []
        begin = time.perf_counter()
        for i in range(int(rate * duration)):
            delay = begin + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies, errors


def summary(latencies: list[float], errors: int) -> dict:
    ms = sorted(x * 1000 for x in latencies)
    return {"requests": len(ms), "errors": errors, "median_ms": round(statistics.median(ms), 3),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3), "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 3)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    p.add_argument("--rounds", type=int, default=3, help="direct then gateway, this many times")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as workdir:
        port = free_port()
        upstream = start(["-m", "uvicorn", "fake_openai_upstream:app", "--app-dir", "scripts", "--port", str(port),
                          "--no-access-log", "--log-level", "warning"], port, f"{workdir}/upstream.log")  # fmt: skip
        config = {
            "models": {"fake": {"replicas": [upstream.url]}},
            "keys": [
                {"name": "bench", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "rpm": 10**9, "tpm": 10**12}
            ],
        }
        gw: Proc = gateway(config, workdir, log_level="info")  # access log on, as in production
        try:
            wait_healthy(upstream, gw)
            wait_upstreams_up(gw)
            headers = {"Authorization": f"Bearer {KEY}"}
            rounds = []
            for i in range(args.rounds):  # interleaved, so background load hits both alike
                one = {}
                for name, url in (("direct", upstream.url), ("gateway", gw.url)):
                    one[name] = summary(*asyncio.run(open_loop(url, args.rate, args.duration, headers)))
                    print(f"round {i} {name}", json.dumps(one[name]), file=sys.stderr)
                one["added_median_ms"] = round(one["gateway"]["median_ms"] - one["direct"]["median_ms"], 3)
                rounds.append(one)
        finally:
            gw.stop()
            upstream.stop()
    added = statistics.median(r["added_median_ms"] for r in rounds)
    direct = statistics.median(r["direct"]["median_ms"] for r in rounds)
    through = statistics.median(r["gateway"]["median_ms"] for r in rounds)
    print(f"rate {args.rate:g}/s, {args.rounds} rounds of {args.duration:g} s: median latency direct {direct:.2f} ms, "
          f"through the gateway {through:.2f} ms; added (median over rounds) {added:.2f} ms")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds, "added_median_ms": added}, f, indent=2)


if __name__ == "__main__":
    main()
