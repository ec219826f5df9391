"""`llmserve bench aborts`: a storm of streams cut at random points, then a check that nothing
is left behind.

Every request streams (completions and chat, `max_tokens` random up to
`--max-tokens`); its client leaves at a random point: before the server answers, after a
random number of chunks, or (`--finish-share` of them) only at the end. `--concurrency` run at
once until `--count` were sent. Then it waits until the server's `/metrics` shows no request
running or waiting and the KV cache empty (vLLM's gauges: `num_requests_running`,
`num_requests_waiting`, `kv_cache_usage_perc`, and llmserve's `num_kv_blocks_used`), and sends
one more request, which must be served whole. Exit status 1 if anything was left or that
request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from llmserve.bench.serve import first_model
from llmserve.bench.serve_client import Target, add_target_args
from llmserve.bench.soak_probes import scrape_gauges

LEFT_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:num_kv_blocks_used")  # fmt: skip


@dataclass
class AbortStorm:
    base_url: str
    model: str
    count: int
    concurrency: int
    cut_before_first_chunk: int = 0  # the client left before reading any chunk
    cut_mid_stream: int = 0
    finished: int = 0  # read to [DONE]
    errors: dict[str, int] = field(default_factory=dict)  # kind -> count (an answer other than a stream)
    seconds: float = 0.0
    settled_after_s: float | None = None  # from the last cut to nothing running and the KV cache empty
    left_behind: dict[str, float] = field(default_factory=dict)  # the gauges when it stopped waiting
    next_request_ok: bool = False

    @property
    def passed(self) -> bool:
        return self.settled_after_s is not None and self.next_request_ok and not self.errors


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("aborts", help="streams cut at random points, then nothing may be left running")
    add_target_args(p)
    p.add_argument("--count", type=int, default=10_000, help="streams to send (and cut)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--finish-share", type=float, default=0.05, help="streams read to the end")
    p.add_argument(
        "--chat-share",
        type=float,
        default=0.5,
        help="chat streams (the rest: completions; 0 for a model without a chat template)",
    )
    p.add_argument("--settle-timeout", type=float, default=60.0, help="seconds to wait for the server to be empty")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> AbortStorm:
    if args.count < 1 or args.concurrency < 1 or args.max_tokens < 1 or not 0 <= args.finish_share <= 1:
        raise SystemExit("llmserve bench aborts: --count, --concurrency and --max-tokens must be >= 1, "
                         "--finish-share in [0, 1]")  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    storm = asyncio.run(abort_storm(args))
    report = json.dumps(asdict(storm) | {"passed": storm.passed}, indent=1)
    print(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(report)
    if not storm.passed:
        raise SystemExit(1)
    return storm


def _body(model: str, i: int, rng: random.Random, max_tokens: int, chat_share: float) -> tuple[str, dict]:
    tokens = rng.randint(1, max_tokens)
    if rng.random() < chat_share:
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": f"tell story {i}"}],
                                        "max_tokens": tokens, "stream": True}  # fmt: skip
    return "/v1/completions", {"model": model, "prompt": f"story {i}:", "max_tokens": tokens, "stream": True,
                               "ignore_eos": True}  # fmt: skip


async def _one(client: httpx.AsyncClient, storm: AbortStorm, i: int, rng: random.Random, args, headers) -> None:
    path, body = _body(storm.model, i, rng, args.max_tokens, args.chat_share)
    finish = rng.random() < args.finish_share
    cut_after = None if finish else rng.randint(0, body["max_tokens"])  # chunks read before leaving
    wait = rng.random() * 0.05  # and a random moment: cuts also land between chunks
    try:
        async with client.stream("POST", storm.base_url + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                kind = f"HTTP {resp.status_code}"
                storm.errors[kind] = storm.errors.get(kind, 0) + 1
                return
            if cut_after == 0:
                await asyncio.sleep(wait)
                storm.cut_before_first_chunk += 1
                return  # leaving the block closes the connection: the server aborts the request
            read = 0
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    storm.finished += 1
                    return
                if line.startswith("data: {"):
                    read += 1
                    if cut_after is not None and read >= cut_after:
                        await asyncio.sleep(wait)
                        storm.cut_mid_stream += 1
                        return
            storm.finished += 1  # ended before the cut point (a short answer)
    except httpx.HTTPError as exc:
        kind = type(exc).__name__
        storm.errors[kind] = storm.errors.get(kind, 0) + 1


async def abort_storm(args: argparse.Namespace) -> AbortStorm:
    base_url = args.base_url.rstrip("/")
    target = Target(base_url, "/v1/models", None, args.api_key)
    headers = target.headers()
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0), limits=limits) as client:
        model = args.model or await first_model(client, target) or ""
        storm = AbortStorm(base_url, model, args.count, args.concurrency)
        rng = random.Random(args.seed)
        indices = iter(range(args.count))  # shared by the workers: each takes the next

        async def worker() -> None:
            for i in indices:
                await _one(client, storm, i, rng, args, headers)
                if (i + 1) % 1000 == 0:
                    print(f"{i + 1}/{args.count} streams sent and cut", flush=True)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        storm.seconds = round(time.monotonic() - start, 1)
        cut = time.monotonic()
        while True:
            gauges = await scrape_gauges(client, base_url, headers, {g: g for g in LEFT_GAUGES})
            storm.left_behind = gauges
            if gauges and all(v == 0 for v in gauges.values()):
                storm.settled_after_s = round(time.monotonic() - cut, 2)
                break
            if time.monotonic() - cut > args.settle_timeout:
                break
            await asyncio.sleep(0.1)
        whole = {"model": model, "prompt": "after the storm", "max_tokens": 8, "ignore_eos": True}
        try:
            resp = await client.post(base_url + "/v1/completions", json=whole, headers=headers)
            storm.next_request_ok = resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
        except (httpx.HTTPError, ValueError, KeyError, TypeError):  # no answer, or not a whole completion
            storm.next_request_ok = False
    return storm
