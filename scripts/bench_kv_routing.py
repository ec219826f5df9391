"""Gateway routing over replicas on a multi-turn trace: kv_aware against prefix_affinity (today's
hash of the prompt's start) and least_outstanding.

For each routing mode, starts N fresh `llmserve serve` replicas (a small KV cache each, KV events
on) and a gateway in front, runs the same `llmserve bench multiturn` trace (same seed) through
the gateway, and reads each replica's prefix cache counters (vllm:prefix_cache_hits /
vllm:prefix_cache_queries) over the run. Reports TTFT (all turns and the turns after the first)
and the hit rate per mode, as a table and JSON.

    OMP_NUM_THREADS=1 python scripts/bench_kv_routing.py --out docs/cpu_kv_routing_2026-12-07.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import httpx
from gateway_bench_lib import ROOT, free_port, gateway, llmserve, metric, wait_healthy, wait_upstreams_up

MODES = ("kv_aware", "prefix_affinity", "least_outstanding")
TINY = os.path.join(ROOT, "llmserve", "assets", "tiny_model")


def start_replicas(args, workdir: str, mode: str):
    replicas, sources = [], {}
    for i in range(args.replicas):
        pub, replay = free_port(), free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay}"}  # fmt: skip
        serve = ["serve", "--model", args.model, "--served-model-name", "chat", "--max-model-len", "1024",
                 "--num-gpu-blocks-override", str(args.num_blocks), "--kv-events-config", json.dumps(events)]  # fmt: skip
        replica = llmserve(serve, f"{workdir}/{mode}-replica{i}.log")
        replicas.append(replica)
        sources[replica.url] = {"endpoint": events["endpoint"], "replay_endpoint": events["replay_endpoint"]}
    return replicas, sources


def counters(replicas) -> list[dict]:
    names = {"hits": "vllm:prefix_cache_hits_total", "queries": "vllm:prefix_cache_queries_total",
             "requests": "vllm:request_success_total"}  # fmt: skip
    return [{k: metric(r.url, name) for k, name in names.items()} for r in replicas]


def run_mode(mode: str, args, workdir: str) -> dict:
    replicas, sources = start_replicas(args, workdir, mode)
    route = {"replicas": [r.url for r in replicas], "routing": mode}
    if mode == "kv_aware":
        route["kv_events"] = {"replicas": sources, "tokenizer": args.model}
    gw = gateway({"models": {"chat": route}}, workdir, name=f"gateway-{mode}")
    try:
        wait_healthy(*replicas, gw, timeout=600)
        wait_upstreams_up(gw)
        before = counters(replicas)
        out = os.path.join(workdir, f"{mode}.json")
        bench = [sys.executable, "-m", "llmserve", "bench", "multiturn", "--base-url", gw.url, "--model", "chat",
                 "--num-conversations", str(args.conversations), "--num-turns", str(args.turns),
                 "--num-system-prompts", str(args.system_prompts), "--system-prompt-len", str(args.system_len),
                 "--user-len", str(args.user_len), "--output-len", str(args.output_len),
                 "--max-concurrency", str(args.concurrency), "--vocab-size", str(args.vocab_size),
                 "--seed", str(args.seed), "--warmup", "0", "--disable-tqdm", "--output-json", out]  # fmt: skip
        subprocess.run(bench, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
        after = counters(replicas)
        decisions = {}
        for line in httpx.get(gw.url + "/metrics").text.splitlines():
            if line.startswith("llmserve_gateway_routing_total{"):
                decision = line.split('decision="', 1)[1].split('"', 1)[0]
                decisions[decision] = decisions.get(decision, 0) + int(float(line.rsplit(" ", 1)[1]))
    finally:
        for p in (gw, *replicas):
            p.stop()
    with open(out) as f:
        run = json.load(f)
    per = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    hits, queries = sum(p["hits"] for p in per), sum(p["queries"] for p in per)
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_ttft_later_turns_ms", "p99_ttft_later_turns_ms", "duration",
            "output_throughput", "completed", "failed", "working_set_tokens")  # fmt: skip
    return {"routing": mode, "prefix_cache_hit_rate": hits / queries if queries else None,
            "prefix_cache_hits": hits, "prefix_cache_queries": queries, "decisions": decisions,
            "requests_per_replica": [int(p["requests"]) for p in per], **{k: run.get(k) for k in keys}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=TINY, help="each replica's model (default: the tiny model)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=96, help="KV blocks (16 tokens) per replica")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=4096, help="the model's (prompt ids are drawn below it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-kv-routing-") as workdir:
        results = [run_mode(mode, args, workdir) for mode in args.modes.split(",")]
    print(f"{'routing':<19}{'hit rate':>9}{'TTFT p50':>10}{'p99':>9}{'later p50':>11}{'p99':>9}  requests per replica")
    for r in results:
        rate = f"{r['prefix_cache_hit_rate']:.1%}" if r["prefix_cache_hit_rate"] is not None else "-"
        print(f"{r['routing']:<19}{rate:>9}{r['median_ttft_ms']:>10.1f}{r['p99_ttft_ms']:>9.1f}"
              f"{r['median_ttft_later_turns_ms']:>11.1f}{r['p99_ttft_later_turns_ms']:>9.1f}  "
              f"{r['requests_per_replica']}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
