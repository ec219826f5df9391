"""Prefix-cache hit rate behind the gateway: least-outstanding versus prefix-affinity routing.

Starts N real `llmserve serve` replicas (the shipped model, CPU, a small KV cache so that not
every system prompt fits on every replica) and one gateway, sends the same chat workload
(several long system prompts shared by many users) in each routing mode, and reads each
replica's vllm:prefix_cache_hits / vllm:prefix_cache_queries. Fresh replicas for each mode.

    python scripts/bench_gateway_affinity.py --out docs/bench_gateway_affinity.json --plot docs/bench_gateway_affinity.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time

import httpx
from gateway_bench_lib import gateway, llmserve, metric, wait_healthy, wait_upstreams_up

WORDS = [  # the recorded run used exactly this list, repeats included
    "the", "module", "returns", "a", "list", "of", "strings", "when", "the", "file", "is", "opened", "in",
    "text", "mode", "and", "each", "line", "ends", "with", "a", "newline", "character", "unless", "the",
    "last", "line", "does", "not", "so", "callers", "should", "strip", "it", "before", "use",
]  # fmt: skip


def workload(args) -> list[list[dict]]:
    rng = random.Random(args.seed)
    systems = [f"You are assistant {i}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for i in range(args.system_prompts)]  # fmt: skip
    users = [f"user {u}: " + " ".join(rng.choice(WORDS) for _ in range(args.user_words)) for u in range(args.requests)]
    return [[{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": users[i]}]
            for i in range(args.requests)]  # fmt: skip


async def drive(url: str, requests: list[list[dict]], concurrency: int, max_tokens: int) -> list[float]:
    queue = list(enumerate(requests))
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def worker() -> None:
            while queue:
                _, messages = queue.pop(0)
                start = time.perf_counter()
                body = {"model": "chat", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                resp = await client.post("/v1/chat/completions", json=body)
                resp.raise_for_status()
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def run_mode(mode: str, args, requests: list[list[dict]], workdir: str) -> dict:
    serve = ["serve", "--max-model-len", "1024", "--served-model-name", "chat",
             "--num-gpu-blocks-override", str(args.num_blocks)]  # fmt: skip
    replicas = [llmserve(serve, f"{workdir}/{mode}-replica{i}.log") for i in range(args.replicas)]
    config = {"models": {"chat": {"replicas": [r.url for r in replicas], "routing": mode}}}
    gw = gateway(config, workdir, name=f"gateway-{mode}")
    try:
        wait_healthy(*replicas, gw)
        wait_upstreams_up(gw)
        started = time.perf_counter()
        latencies = asyncio.run(drive(gw.url, requests, args.concurrency, args.max_tokens))
        elapsed = time.perf_counter() - started
        per = [{"hits": metric(r.url, "vllm:prefix_cache_hits_total"),
                "queries": metric(r.url, "vllm:prefix_cache_queries_total"),
                "requests": metric(r.url, "vllm:request_success_total")} for r in replicas]  # fmt: skip
    finally:
        for p in (gw, *replicas):
            p.stop()
    hits, queries = sum(p["hits"] for p in per), sum(p["queries"] for p in per)
    return {
        "routing": mode, "requests": len(latencies), "duration_s": round(elapsed, 2),
        "request_throughput": round(len(latencies) / elapsed, 2),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "median_latency_ms": round(statistics.median(latencies) * 1000, 1),
        "p99_latency_ms": round(sorted(latencies)[int(0.99 * (len(latencies) - 1))] * 1000, 1),
        "per_replica": per,
    }  # fmt: skip


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["routing"] for r in results]
    axes[0].bar(names, [r["prefix_cache_hit_rate"] * 100 for r in results], color=["#999", "#2a7"])
    axes[0].set_ylabel("prefix-cache hit rate (%)")
    axes[1].bar(names, [r["median_latency_ms"] for r in results], color=["#999", "#2a7"])
    axes[1].set_ylabel("median latency (ms)")
    fig.suptitle("Gateway routing over replicas, shared system prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=12)
    p.add_argument("--system-words", type=int, default=150, help="about one token a word")
    p.add_argument("--user-words", type=int, default=12)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=64, help="KV blocks (16 tokens) per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--plot", default=None, help="PNG bar chart")
    args = p.parse_args()
    requests = workload(args)
    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as workdir:
        results = [run_mode(mode, args, requests, workdir) for mode in ("least_outstanding", "prefix_affinity")]
    print(f"{'routing':<20}{'hit rate':>10}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}  requests per replica")
    for r in results:
        spread = [int(x["requests"]) for x in r["per_replica"]]
        print(f"{r['routing']:<20}{r['prefix_cache_hit_rate']:>10.1%}{r['request_throughput']:>8.2f}"
              f"{r['median_latency_ms']:>9.1f}{r['p99_latency_ms']:>9.1f}  {spread}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
