"""`llmserve bench serve`: load an OpenAI-compatible server and measure what clients see.

Random token-id prompts of exact length, sent at a Poisson (or gamma, `--burstiness`)
request rate or all at once (`inf`), optionally capped at `--max-concurrency` in flight;
every response streamed and timed on the client. The report and JSON follow
`vllm bench serve`, so a run against llmserve and one against vLLM compare line by line.
This is a client: it speaks HTTP only and works against any OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from datetime import datetime

import httpx
import numpy as np
from tqdm import tqdm

from llmserve import heap
from llmserve.bench.prompts import SyntheticRequest, random_requests
from llmserve.bench.report import banner, metric_rows, parse_percentiles, percentile_word, row, write_json
from llmserve.bench.serve_client import RequestResult, Target, open_client, send
from llmserve.bench.serve_metrics import LATENCY_METRICS, compute_metrics, parse_goodput
from llmserve.bench.server_metrics import PHASES, scrape, server_side

METRIC_TITLES = {  # name -> (section header, label), as vLLM prints them
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
# for chat prompts when the server cannot detokenize: about one token per word
_WORDS = "time year people way day man thing woman life child world school state family student group".split()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="online benchmark of an OpenAI-compatible server (any server)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn from [10, this)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=None, help="prompt and arrival seed (default: fresh each run)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension): exact output lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000"
    )
    p.add_argument(
        "--percentiles",
        "--metric-percentiles",
        default="90,99",
        help="comma-separated, e.g. 50,90,99 (mean and median are always reported)",
    )
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics to print")
    add_run_args(p, "request", "per-request lists", "latency over time and ITL histogram/CDF")
    p.set_defaults(func=run)


def add_run_args(p, unit: str, detail: str, plot: str) -> None:
    """The options `bench serve` and `bench multiturn` share: warm-up, timeout, outputs."""
    p.add_argument("--warmup", type=int, default=1, help="untimed single requests first (own prompts)")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help=f"seconds per {unit}")
    p.add_argument("--label", default=None, help="free text stored in the JSON")
    p.add_argument("--output-json", default=None)
    p.add_argument("--save-detailed", action="store_true", help=f"{detail} in the JSON too")
    p.add_argument("--plot", default=None, metavar="FILE.png", help=plot)
    p.add_argument("--disable-tqdm", action="store_true")


def run(args: argparse.Namespace) -> dict:
    percentiles = parse_percentiles(args.percentiles)
    slos = parse_goodput(args.goodput)
    shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := set(shown) - set(LATENCY_METRICS):
        raise ValueError(f"--percentile-metrics: unknown {', '.join(sorted(unknown))}; use {','.join(LATENCY_METRICS)}")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    target, results, duration, server = asyncio.run(_benchmark(args, seed, percentiles))
    metrics = compute_metrics(results, duration, percentiles, slos)
    print(format_report(metrics, args, shown, percentiles, bool(slos), server))
    _print_errors(results)
    result = _result_json(args, target, seed, percentiles, slos, metrics, results) | {"server_metrics": server}
    if args.output_json:
        write_json(args.output_json, result)
    if args.plot:
        from llmserve.bench.plot import plot_serve

        plot_serve(
            results,
            args.plot,
            f"{target.model} @ {args.base_url}: {args.num_prompts} req, "
            f"{args.input_len} in / {args.output_len} out, rate {args.request_rate}",
        )
    return result


async def _benchmark(
    args: argparse.Namespace, seed: int, percentiles: Sequence[float]
) -> tuple[Target, list[RequestResult], float, dict | None]:
    async with open_client(args.request_timeout) as client:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        target = Target(args.base_url, args.endpoint, None, api_key, args.ignore_eos, args.temperature)
        target.model = args.model or await first_model(client, target)
        reqs = random_requests(
            args.warmup + args.num_prompts, args.input_len, args.output_len, args.vocab_size, seed, args.range_ratio
        )
        prompts = await chat_prompts(client, target, reqs, seed) if target.chat else [r.prompt_token_ids for r in reqs]
        if args.warmup:
            await warm_up(client, target, reqs[: args.warmup], prompts[: args.warmup])
        reqs, prompts = reqs[args.warmup :], prompts[args.warmup :]
        offsets = arrival_offsets(len(reqs), args.request_rate, args.burstiness, seed)
        print(
            f"Traffic request rate: {args.request_rate}, burstiness factor: {args.burstiness}"
            f"{' (Poisson process)' if args.burstiness == 1.0 else ''}, "
            f"maximum request concurrency: {args.max_concurrency}, seed: {seed}"
        )
        before = await scrape(client, target.base_url, target.headers())
        # the client's own full collections would stall every stream at once (~0.1 s with
        # 190k start-up objects on the GPU host), read as the server's latency: keep the
        # heap built so far out of their scans while measuring
        with heap.frozen("bench serve client"):
            results, duration = await run_load(
                client, target, reqs, prompts, offsets, args.max_concurrency, progress=not args.disable_tqdm
            )
        server = server_side(before, await scrape(client, target.base_url, target.headers()), percentiles)
    return target, results, duration, server


async def first_model(client: httpx.AsyncClient, target: Target) -> str | None:
    """The first model of /v1/models; None (no `model` field sent) if the server does not say."""
    try:
        resp = await client.get(target.base_url.rstrip("/") + "/v1/models", headers=target.headers())
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - the requests themselves will report the failure
        print(
            f"warning: could not read /v1/models ({type(exc).__name__}: {exc}); sending no model name", file=sys.stderr
        )
        return None


async def chat_prompts(
    client: httpx.AsyncClient, target: Target, reqs: Sequence[SyntheticRequest], seed: int
) -> list[str]:
    """Chat needs text: the server's /detokenize of the random ids, else random common words.

    The server re-tokenizes (and adds its chat template), so the input length it reports
    in usage is what the results count."""
    url = target.base_url.rstrip("/") + "/detokenize"

    async def detokenize(ids: list[int]) -> str:
        body = {"tokens": ids} | ({"model": target.model} if target.model else {})
        resp = await client.post(url, json=body, headers=target.headers())
        resp.raise_for_status()
        return resp.json()["prompt"]

    try:
        return list(await asyncio.gather(*(detokenize(r.prompt_token_ids) for r in reqs)))
    except Exception:  # noqa: BLE001 - not every OpenAI server has /detokenize
        rng = random.Random(seed)
        return [" ".join(rng.choice(_WORDS) for _ in range(r.prompt_len)) for r in reqs]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gamma-distributed gaps of
    mean 1/rate (shape `burstiness`; 1 is a Poisson process). All 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


async def warm_up(client: httpx.AsyncClient, target: Target, reqs: Sequence[SyntheticRequest], prompts: list) -> None:
    print(f"Warming up with {len(reqs)} request(s)...")
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(send(client, target, p, r.prompt_len, r.output_len, t0) for r, p in zip(reqs, prompts))
    )
    failed = [r for r in results if not r.success]
    if failed and len(failed) == len(results) and failed[0].error.startswith("HTTP 4"):
        # the server refuses the benchmark's own requests: every timed one would fail the same way
        raise SystemExit(
            f"llmserve bench: the server refused the warm-up request ({failed[0].error}); "
            "check --vocab-size (prompt ids are drawn below it), --model, --input-len and --output-len"
        )
    if failed:
        print(f"warning: {len(failed)} warm-up request(s) failed: {failed[0].error}", file=sys.stderr)


async def run_load(
    client: httpx.AsyncClient,
    target: Target,
    reqs: Sequence[SyntheticRequest],
    prompts: list,
    offsets: Sequence[float],
    max_concurrency: int | None,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send every request at its offset (waiting for a slot under `max_concurrency`);
    returns the results in request order and the duration, start to last response."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(reqs), disable=not progress)

    async def one(req: SyntheticRequest, prompt) -> RequestResult:
        async with limit:
            res = await send(client, target, prompt, req.prompt_len, req.output_len, t0)
        bar.update(1)
        return res

    tasks = []
    t0 = time.perf_counter()
    for req, prompt, offset in zip(reqs, prompts, offsets):
        # sleep to absolute send times, so scheduling delays do not accumulate
        if (delay := t0 + offset - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, prompt)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    bar.close()
    return results, duration


def format_report(
    m: dict,
    args: argparse.Namespace,
    shown: Sequence[str],
    percentiles: Sequence[float],
    goodput: bool,
    server: dict | None = None,
) -> str:
    lines = [
        banner("Serving Benchmark Result"),
        row("Successful requests:", m["completed"]),
        row("Failed requests:", m["failed"]),
    ]
    if args.max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", args.max_concurrency))
    if not math.isinf(args.request_rate):
        lines.append(row("Request rate configured (RPS):", float(args.request_rate)))
    lines += [
        row("Benchmark duration (s):", m["duration"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
    ]
    if goodput:
        lines.append(row("Request goodput (req/s):", m["request_goodput"]))
    lines += [
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"]),
        row("Peak concurrent requests:", m["max_concurrent_requests"]),
        row("Total Token throughput (tok/s):", m["total_token_throughput"]),
    ]
    for name in shown:
        header, label = METRIC_TITLES[name]
        lines.append(banner(header, "-"))
        lines += metric_rows(m, name, label, percentiles)
    if server:  # the same run as the server's /metrics saw it
        lines.append(banner("Server side (/metrics)", "-"))
        for key, _, label in PHASES:
            if f"mean_{key}_ms" in server:
                lines.append(row(f"Mean {label} (ms):", server[f"mean_{key}_ms"]))
        for p in percentiles:
            if (bound := server.get(f"p{percentile_word(p)}_ttft_bucket_ms")) is not None:
                lines.append(row(f"P{percentile_word(p)} TTFT at most (ms, bucket):", bound))
    lines.append("=" * 50)
    return "\n".join(lines)


def _print_errors(results: Sequence[RequestResult]) -> None:
    errors = sorted({r.error for r in results if not r.success})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    if len(errors) > 5:
        print(f"... and {len(errors) - 5} other distinct errors", file=sys.stderr)


def _result_json(
    args: argparse.Namespace,
    target: Target,
    seed: int,
    percentiles: Sequence[float],
    slos: dict[str, float],
    metrics: dict,
    results: Sequence[RequestResult],
) -> dict:
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if target.chat else "openai",
        "label": args.label,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model_id": target.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": seed,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "percentiles": list(percentiles),
        "goodput": slos or None,
        **metrics,
    }
    if args.save_detailed:
        result |= {
            "start_times": [r.start for r in results],
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results],
            "e2els": [r.latency for r in results],
            "itls": [r.itl for r in results],
            "errors": [r.error for r in results],
            "sent_wall_times": [r.sent_wall_time for r in results],
            "response_ids": [r.response_id for r in results],
        }
    return result
