"""What the server says about the same run: its `/metrics` (vLLM's `vllm:*` histograms)
read before and after the load, so a report can split the client's TTFT into the server's
queue time (in the engine core's queue until first scheduled), prefill time (to the core's
first token) and the rest (tokenization and IPC inside the server; HTTP, streaming and the
client itself outside it).

Only HTTP and the Prometheus text format: works against any server with vLLM's metric
names (ours or vLLM's), and quietly yields nothing against one without them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import httpx

from llmserve.bench.report import percentile_word

# (key in the report, histogram name, label in the table)
PHASES = (
    ("ttft", "vllm:time_to_first_token_seconds", "TTFT"),
    ("queue", "vllm:request_queue_time_seconds", "queue time"),
    ("prefill", "vllm:request_prefill_time_seconds", "prefill time"),
    ("decode", "vllm:request_decode_time_seconds", "decode time"),
    ("e2el", "vllm:e2e_request_latency_seconds", "E2EL"),
)
Snapshot = dict[str, float]  # "name_sum" / "name_count" / "name_bucket|le" -> summed over other labels


def parse(text: str) -> Snapshot:
    """The histogram samples of PHASES in Prometheus text, summed over label sets (e.g.
    several models) but kept apart by bucket bound."""
    wanted = tuple(name for _, name, _ in PHASES)
    out: Snapshot = {}
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if not name.endswith(("_sum", "_count", "_bucket")):
            continue
        key = name
        if name.endswith("_bucket"):
            le = next(
                (p.split("=", 1)[1].strip('"') for p in labels.rstrip("}").split(",") if p.startswith("le=")), None
            )
            if le is None:
                continue
            key = f"{name}|{le}"
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def scrape(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> Snapshot | None:
    """The server's histograms now; None if it has no `/metrics` with them."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
        resp.raise_for_status()
    except (httpx.HTTPError, OSError):
        return None
    snap = parse(resp.text)
    return snap or None


def bucket_percentile(before: Snapshot, after: Snapshot, name: str, p: float) -> float | None:
    """The upper bound of the bucket holding the p-th percentile of the observations
    between the two snapshots (inf if beyond the last bound; None if none)."""
    bounds = sorted(
        (float(k.split("|", 1)[1]), after[k] - before.get(k, 0.0))
        for k in after if k.startswith(name + "_bucket|")
    )  # fmt: skip
    if not bounds or bounds[-1][1] <= 0:
        return None
    total = bounds[-1][1]  # le="+Inf" is cumulative over all
    for bound, cumulative in bounds:
        if cumulative >= total * p / 100:
            return bound
    return math.inf


def server_side(before: Snapshot | None, after: Snapshot | None, percentiles: Sequence[float]) -> dict | None:
    """Per phase: requests finished in between, their mean (ms), and for TTFT the bucket
    bound of each percentile (ms). None without both snapshots."""
    if before is None or after is None:
        return None
    out: dict = {}
    for key, name, _ in PHASES:
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count <= 0:
            continue
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        out[f"{key}_count"] = int(count)
        out[f"mean_{key}_ms"] = total / count * 1000
    if "ttft_count" in out:
        for p in percentiles:
            bound = bucket_percentile(before, after, "vllm:time_to_first_token_seconds", p)
            if bound is not None:
                out[f"p{percentile_word(p)}_ttft_bucket_ms"] = bound * 1000
    return out or None
