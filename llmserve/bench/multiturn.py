"""`llmserve bench multiturn`: conversations whose history outgrows the server's KV cache.

N conversations of M turns. Each turn sends the whole history as token ids to /v1/completions
(the group's system prompt, then every earlier user message and reply, then a new user
message of random ids) and streams the reply (`ignore_eos`, exact lengths). The reply's ids
come from the stream (`return_token_ids`, vLLM's extension, which llmserve has too; else the
server's /tokenize of its text), so each turn's prompt is exactly the previous turn's prompt
and reply plus the new message: what the prefix cache can reuse. Conversations are
interleaved under a concurrency limit (FIFO: a conversation's next turn queues behind every
other conversation's), so between two turns of one conversation all the others run, and the
working set (every history at its end, a shared system prompt once) can be made larger than
the server's KV cache by any factor. A prefix evicted from the device comes back from a lower
tier (`--kv-offload-cpu-gb`, then `--kv-offload-disk-path`) or is recomputed: the TTFT of the turns after the first shows which.

Reported per run: TTFT over all turns and over the turns after the first, by turn index,
throughput, and the server's own counters over the run (`/metrics` before and after): prefix
cache hit rate, host- and disk-tier hit tokens and blocks moved, preemptions; a counter the
server does not export (vLLM has no host tier metric) is None. An HTTP client only, like `bench serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import httpx
from tqdm import tqdm

from llmserve import heap
from llmserve.bench.prompts import FIRST_ID, draw_len, random_requests
from llmserve.bench.report import banner, metric_rows, parse_percentiles, row, summarize, write_json
from llmserve.bench.serve import add_run_args, first_model, warm_up
from llmserve.bench.serve_client import RequestResult, Target, open_client, send
from llmserve.bench.serve_metrics import compute_metrics
from llmserve.bench.server_metrics import scrape, server_side
from llmserve.bench.soak_probes import scrape_gauges

# /metrics series (counters as the Prometheus text names them) -> key in the report
KV_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "llmserve:kv_offload_hit_tokens_total": "kv_offload_hit_tokens",
    "llmserve:kv_offload_stored_blocks_total": "kv_offload_stored_blocks",
    "llmserve:kv_offload_loaded_blocks_total": "kv_offload_loaded_blocks",
    "llmserve:kv_disk_hit_tokens_total": "kv_disk_hit_tokens",
    "llmserve:kv_disk_stored_blocks_total": "kv_disk_stored_blocks",
    "llmserve:kv_disk_loaded_blocks_total": "kv_disk_loaded_blocks",
    "llmserve:kv_disk_errors_total": "kv_disk_errors",
    "vllm:num_preemptions_total": "num_preemptions",
}
KV_CAPACITY = {"llmserve:kv_cache_tokens": "kv_cache_tokens"}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("multiturn", help="multi-turn conversations whose KV working set exceeds the cache")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--num-conversations", type=int, default=64)
    p.add_argument("--num-turns", type=int, default=4, help="user messages (and replies) per conversation")
    p.add_argument("--num-system-prompts", type=int, default=4, help="groups: conversation i has system prompt i %% K")
    p.add_argument("--system-prompt-len", type=int, default=2048, help="tokens of each group's system prompt")
    p.add_argument("--user-len", type=int, default=256, help="tokens of each user message")
    p.add_argument("--output-len", type=int, default=128, help="max (with --ignore-eos: exact) tokens of each reply")
    p.add_argument("--range-ratio", type=float, default=0.0, help="user and reply lengths in [len*(1-r), len*(1+r)]")
    p.add_argument("--max-concurrency", type=int, default=8, help="most turns in flight at once")
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn from [10, this)")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: fresh each run)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos (vLLM extension): replies of exact length")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated (mean and median always)")
    add_run_args(p, "turn", "every turn's numbers", "TTFT by turn index and by prompt length")
    p.set_defaults(func=run)


@dataclass
class Conversation:
    index: int
    system: list[int]  # shared by the conversations of a group
    users: list[list[int]]  # one message a turn
    output_lens: list[int]

    @property
    def final_len(self) -> int:
        """Tokens of the whole history after the last reply."""
        return len(self.system) + sum(map(len, self.users)) + sum(self.output_lens)


@dataclass
class TurnResult:
    conversation: int
    turn: int
    result: RequestResult
    reply_ids_from: str = ""  # "token_ids" (the stream), "tokenize" (/tokenize of the text), "none"


def make_conversations(args: argparse.Namespace, seed: int) -> list[Conversation]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_ID, args.vocab_size) for _ in range(n)]

    systems = [ids(args.system_prompt_len) for _ in range(args.num_system_prompts)]
    return [
        Conversation(
            i,
            systems[i % len(systems)],
            [ids(draw_len(rng, args.user_len, args.range_ratio)) for _ in range(args.num_turns)],
            [draw_len(rng, args.output_len, args.range_ratio) for _ in range(args.num_turns)],
        )
        for i in range(args.num_conversations)
    ]


def working_set_tokens(convs: Sequence[Conversation]) -> int:
    """KV tokens every conversation's history needs at its end, each system prompt counted once."""
    systems = {id(c.system): len(c.system) for c in convs}
    return sum(systems.values()) + sum(c.final_len - len(c.system) for c in convs)


def run(args: argparse.Namespace) -> dict:
    percentiles = parse_percentiles(args.percentiles)
    counts = (args.num_conversations, args.num_turns, args.num_system_prompts, args.user_len, args.output_len,
              args.max_concurrency)  # fmt: skip
    if min(counts) < 1 or args.system_prompt_len < 0:
        raise ValueError("--num-conversations, --num-turns, --num-system-prompts, --user-len, --output-len and "
                         "--max-concurrency must be >= 1, --system-prompt-len >= 0")  # fmt: skip
    if not 0.0 <= args.range_ratio < 1.0 or args.vocab_size <= FIRST_ID:
        raise ValueError(f"--range-ratio must be in [0, 1) and --vocab-size > {FIRST_ID}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    convs = make_conversations(args, seed)
    model, turns, duration, kv, server = asyncio.run(_benchmark(args, convs, seed, percentiles))
    result = summarize_run(args, model, seed, convs, turns, duration, kv, percentiles) | {"server_metrics": server}
    print(format_report(result, percentiles))
    errors = sorted({t.result.error for t in turns if not t.result.success})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    if args.output_json:
        write_json(args.output_json, result)
    if args.plot:
        from llmserve.bench.plot import plot_multiturn

        plot_multiturn(
            [(t.turn, t.result) for t in turns],
            args.plot,
            f"{model} @ {args.base_url}: {args.num_conversations} conversations x {args.num_turns} turns, "
            f"working set {result['working_set_tokens']} tokens, KV cache {result['kv_cache_tokens']}",
        )
    return result


async def _benchmark(
    args: argparse.Namespace, convs: list[Conversation], seed: int, percentiles: Sequence[float]
) -> tuple[str | None, list[TurnResult], float, dict, dict | None]:
    async with open_client(args.request_timeout) as client:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        target = Target(args.base_url, "/v1/completions", None, api_key, args.ignore_eos, args.temperature, True)
        target.model = args.model or await first_model(client, target)
        if args.warmup:
            warm = random_requests(args.warmup, args.user_len, args.output_len, args.vocab_size, seed + 1)
            await warm_up(client, target, warm, [r.prompt_token_ids for r in warm])
        capacity = await kv_capacity(client, target)
        ws = working_set_tokens(convs)
        ratio = f" ({ws / capacity:.1f}x)" if capacity else ""
        print(f"{len(convs)} conversations x {args.num_turns} turns, at most {args.max_concurrency} turns in flight, "
              f"seed {seed}: KV working set {ws} tokens; the server's KV cache {capacity} tokens{ratio}")  # fmt: skip
        before = await scrape_gauges(client, target.base_url, target.headers(), KV_COUNTERS)
        hist_before = await scrape(client, target.base_url, target.headers())
        with heap.frozen("bench multiturn client"):  # as bench serve: no GC stall read as latency
            turns, duration = await run_conversations(
                client, target, convs, args.max_concurrency, progress=not args.disable_tqdm
            )
        after = await scrape_gauges(client, target.base_url, target.headers(), KV_COUNTERS)
        server = server_side(hist_before, await scrape(client, target.base_url, target.headers()), percentiles)
    kv = kv_deltas(before, after) | {"kv_cache_tokens": capacity}
    return target.model, turns, duration, kv, server


async def kv_capacity(client: httpx.AsyncClient, target: Target) -> int | None:
    """Tokens the server's KV cache holds: llmserve's gauge, else vLLM's cache_config_info
    (num_gpu_blocks x block_size in its labels); None if neither."""
    found = await scrape_gauges(client, target.base_url, target.headers(), KV_CAPACITY)
    if found.get("kv_cache_tokens"):  # 0 until the engine's first step reported its stats
        return int(found["kv_cache_tokens"])
    try:
        resp = await client.get(target.base_url.rstrip("/") + "/metrics", headers=target.headers())
        line = next(x for x in resp.text.splitlines() if x.startswith("vllm:cache_config_info{"))
        labels = dict(kv.split("=", 1) for kv in line.split("{", 1)[1].rsplit("}", 1)[0].split(","))
        return int(labels["num_gpu_blocks"].strip('"')) * int(labels["block_size"].strip('"'))
    except (httpx.HTTPError, StopIteration, KeyError, ValueError):
        return None


def kv_deltas(before: dict[str, float], after: dict[str, float]) -> dict:
    """Each KV counter's growth over the run (None where the server does not export it), and
    the prefix cache's hit rate (hit tokens / looked-up tokens)."""
    out: dict = {key: int(after[key] - before.get(key, 0.0)) if key in after else None for key in KV_COUNTERS.values()}
    queries, hits = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = hits / queries if queries and hits is not None else None
    return out


async def run_conversations(
    client: httpx.AsyncClient,
    target: Target,
    convs: Sequence[Conversation],
    max_concurrency: int,
    progress: bool = True,
) -> tuple[list[TurnResult], float]:
    """Every conversation as its own task, their turns under one FIFO limit: a conversation's
    next turn waits behind the turns queued before it. A failed turn ends its conversation
    (its history would be unknown). Returns the turns in the order they ended, and the duration."""
    limit = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=sum(len(c.users) for c in convs), disable=not progress)
    turns: list[TurnResult] = []

    async def converse(conv: Conversation) -> None:
        history = list(conv.system)
        for index, (user, max_tokens) in enumerate(zip(conv.users, conv.output_lens)):
            prompt = history + user
            async with limit:
                res = await send(client, target, prompt, len(prompt), max_tokens, t0)
            turn = TurnResult(conv.index, index, res)
            turns.append(turn)
            bar.update(1)
            if not res.success:
                return
            reply, turn.reply_ids_from = await reply_ids(client, target, res)
            history = prompt + reply

    t0 = time.perf_counter()
    await asyncio.gather(*(converse(c) for c in convs))
    duration = time.perf_counter() - t0
    bar.close()
    return turns, duration


async def reply_ids(client: httpx.AsyncClient, target: Target, res: RequestResult) -> tuple[list[int], str]:
    """The reply's token ids: as the stream gave them, else the server's /tokenize of its
    text (no special tokens), else none (the next prompt still extends this one)."""
    if res.output_ids:
        return res.output_ids, "token_ids"
    body = {"prompt": res.text, "add_special_tokens": False} | ({"model": target.model} if target.model else {})
    try:
        resp = await client.post(target.base_url.rstrip("/") + "/tokenize", json=body, headers=target.headers())
        resp.raise_for_status()
        return list(resp.json()["tokens"]), "tokenize"
    except (httpx.HTTPError, KeyError, ValueError):
        return [], "none"


def summarize_run(
    args: argparse.Namespace,
    model: str | None,
    seed: int,
    convs: Sequence[Conversation],
    turns: Sequence[TurnResult],
    duration: float,
    kv: dict,
    percentiles: Sequence[float],
) -> dict:
    results = [t.result for t in turns]
    metrics = compute_metrics(results, duration, percentiles, {})
    later = [t.result.ttft for t in turns if t.turn > 0 and t.result.success]
    by_turn = []
    for index in range(args.num_turns):
        ttfts = [t.result.ttft for t in turns if t.turn == index and t.result.success]
        by_turn.append({"turn": index, "completed": len(ttfts)} | summarize(ttfts, percentiles, "ttft_ms", 1000.0))
    ws, capacity = working_set_tokens(convs), kv["kv_cache_tokens"]
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "label": args.label,
        "base_url": args.base_url,
        "model_id": model,
        "num_conversations": args.num_conversations,
        "num_turns": args.num_turns,
        "num_system_prompts": args.num_system_prompts,
        "system_prompt_len": args.system_prompt_len,
        "user_len": args.user_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "max_concurrency": args.max_concurrency,
        "seed": seed,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "percentiles": list(percentiles),
        "working_set_tokens": ws,
        "working_set_factor": ws / capacity if capacity else None,
        "skipped_turns": args.num_conversations * args.num_turns - len(turns),
        "reply_ids_from": dict(Counter(t.reply_ids_from for t in turns if t.reply_ids_from)),
        **metrics,
        **summarize(later, percentiles, "ttft_later_turns_ms", 1000.0),
        "ttft_by_turn": by_turn,
        **kv,
    }
    if args.save_detailed:
        result["turns"] = [
            {"conversation": t.conversation, "turn": t.turn, "start": t.result.start, "prompt_len": t.result.prompt_len,
             "output_tokens": t.result.output_tokens, "ttft": t.result.ttft, "latency": t.result.latency,
             "error": t.result.error}
            for t in turns
        ]  # fmt: skip
    return result


def format_report(r: dict, percentiles: Sequence[float]) -> str:
    def maybe(value):
        return "None" if value is None else value

    lines = [
        banner("Multi-turn Benchmark Result"),
        row("Conversations x turns:", f"{r['num_conversations']} x {r['num_turns']}"),
        row("Successful turns:", r["completed"]),
        row("Failed turns:", r["failed"]),
        row("Skipped turns (after a failure):", r["skipped_turns"]),
        row("Maximum turn concurrency:", r["max_concurrency"]),
        row("KV working set (tokens):", r["working_set_tokens"]),
        row("Server KV cache (tokens):", maybe(r["kv_cache_tokens"])),
        row("Working set / KV cache:", maybe(r["working_set_factor"])),
        row("Benchmark duration (s):", r["duration"]),
        row("Total input tokens:", r["total_input_tokens"]),
        row("Total generated tokens:", r["total_output_tokens"]),
        row("Output token throughput (tok/s):", r["output_throughput"]),
        row("Total Token throughput (tok/s):", r["total_token_throughput"]),
        banner("Time to First Token, all turns", "-"),
        *metric_rows(r, "ttft", "TTFT", percentiles),
        banner("Time to First Token, turns after the first", "-"),
        *metric_rows(r, "ttft_later_turns", "TTFT", percentiles),
        banner("TTFT by turn", "-"),
        *(
            row(f"Turn {t['turn']} median / P99 (ms):", f"{t['median_ttft_ms']:.2f} / {t['p99_ttft_ms']:.2f}")
            for t in r["ttft_by_turn"]
        ),  # fmt: skip
        banner("KV cache, server side (/metrics)", "-"),
        row("Prefix cache queries (tokens):", maybe(r["prefix_cache_queries"])),
        row("Prefix cache hits (tokens):", maybe(r["prefix_cache_hits"])),
        row("Prefix cache hit rate:", maybe(r["prefix_cache_hit_rate"])),
        row("Host tier hit tokens:", maybe(r["kv_offload_hit_tokens"])),
        row(
            "Host tier blocks stored / loaded:",
            f"{maybe(r['kv_offload_stored_blocks'])} / {maybe(r['kv_offload_loaded_blocks'])}",
        ),  # fmt: skip
        row("Disk tier hit tokens:", maybe(r["kv_disk_hit_tokens"])),
        row(
            "Disk tier blocks stored / loaded; errors:",
            f"{maybe(r['kv_disk_stored_blocks'])} / {maybe(r['kv_disk_loaded_blocks'])}; {maybe(r['kv_disk_errors'])}",
        ),  # fmt: skip
        row("Preemptions:", maybe(r["num_preemptions"])),
        "=" * 50,
    ]
    return "\n".join(lines)
