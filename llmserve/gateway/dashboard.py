"""The status sampler behind the live status page (`/dashboard`, `/dashboard/data`: routes.py)
and behind admission's shedding by the engines' queues.

It scrapes every upstream's `/metrics` (vLLM's names) once a second — an OpenAI server's
route, a Triton chat model's `/metrics` endpoint (the engine's page, as `llmserve serve` gives
it) — and keeps the last five minutes in a ring buffer per upstream, beside the gateway's own
request counters. From them it tells each engine's state (engine_state.py: ok, saturated,
stuck), for /health and the metrics, and keeps each Triton chat model's latest page, which the
gateway's /metrics passes on (Triton listens on this host only under `llmserve up`). The page
(llmserve/assets/dashboard.html, no external scripts) polls `/dashboard/data` and draws
running and waiting requests, KV-cache usage, tokens/s and latency per model and upstream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import httpx

from llmserve.gateway.engine_state import EngineState, engine_state
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.placement import GatewayPlacement
from llmserve.gateway.router import Replica, Router
from llmserve.gateway.triton_upstream import TritonClients

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0  # one scrape of every upstream a second
HISTORY = 300  # samples kept: five minutes
LATEST_SPAN = 5  # the headline numbers are rates over the last five samples
PAGE = Path(__file__).resolve().parents[1] / "assets" / "dashboard.html"

# sample field -> the upstream's metric (summed over its label sets)
_METRICS = MappingProxyType(
    {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_usage": "vllm:kv_cache_usage_perc",
        "generation_tokens": "vllm:generation_tokens_total",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "ttft_sum": "vllm:time_to_first_token_seconds_sum",
        "ttft_count": "vllm:time_to_first_token_seconds_count",
        "itl_sum": "vllm:inter_token_latency_seconds_sum",
        "itl_count": "vllm:inter_token_latency_seconds_count",
        "e2e_sum": "vllm:e2e_request_latency_seconds_sum",
        "e2e_count": "vllm:e2e_request_latency_seconds_count",
        "queue_sum": "vllm:request_queue_time_seconds_sum",
        "queue_count": "vllm:request_queue_time_seconds_count",
    }
)
_NAMES = MappingProxyType({metric: field for field, metric in _METRICS.items()})
_MODEL_NAME = re.compile(r'model_name="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    """One scrape of one upstream; `values` is empty when the scrape failed."""

    t: float
    values: dict[str, float]
    model: str | None = None


@dataclass
class Point:
    """An upstream over one span: gauges at its end, rates and mean latencies within it."""

    t: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    tokens_per_s: float | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None
    queue_ms: float | None = None  # mean wait in the engine's queue of the requests it scheduled


@dataclass
class UpstreamStatus:
    url: str
    aliases: list[str]
    model: str | None  # the model_name the upstream reports
    healthy: bool  # the gateway's breaker
    has_metrics: bool  # an OpenAI upstream with /metrics, or a Triton chat model (embed and rerank have none)
    scraped: bool  # its last /metrics scrape worked
    outstanding: int  # requests the gateway has in flight there
    latest: Point | None
    series: list[Point]


@dataclass
class ModelStatus:
    alias: str
    replicas: list[str]
    healthy_replicas: int
    requests_per_s: float | None  # answered by the gateway for this alias
    running: float
    waiting: float
    kv_usage: float | None  # the fullest replica
    tokens_per_s: float
    placement: str | None = None  # resident, asleep, waking, sleeping: a placed model's state


@dataclass
class DashboardData:
    time: float
    interval_s: float
    window_s: float
    requests_per_s: float | None
    rejections: dict[str, float]  # since the gateway started, by reason
    models: list[ModelStatus]
    upstreams: list[UpstreamStatus]
    placement: dict | None = None  # the placed models' budget, memory and states (docs/placement.md)


def parse_metrics(text: str) -> Sample:
    """The fields of `_METRICS` from a Prometheus text page (absent metrics are left out).

    A plain line scan, not a full exposition parser: it runs in the gateway's event loop
    every second for every upstream, and reads a dozen series out of a few hundred lines."""
    values: dict[str, float] = {}
    model = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name = line[: brace if brace >= 0 else line.find(" ")]
        field = _NAMES.get(name)
        if field is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        values[field] = values.get(field, 0.0) + value
        if model is None and brace >= 0 and (m := _MODEL_NAME.search(line, brace)):
            model = m.group(1)
    return Sample(time.time(), values, model)


def _ratio(num: float | None, den: float | None, scale: float = 1.0) -> float | None:
    if num is None or den is None or den <= 0 or num < 0:
        return None  # nothing happened, or the counters were reset (the upstream restarted)
    return round(num / den * scale, 3)


def span_point(a: Sample, b: Sample) -> Point:
    """What happened between two samples of one upstream."""

    def delta(field: str) -> float | None:
        if field in a.values and field in b.values:
            return b.values[field] - a.values[field]
        return None

    gauges = {f: b.values.get(f) for f in ("running", "waiting", "kv_usage")}
    return Point(
        t=b.t, **gauges,
        tokens_per_s=_ratio(delta("generation_tokens"), b.t - a.t),
        ttft_ms=_ratio(delta("ttft_sum"), delta("ttft_count"), 1000.0),
        itl_ms=_ratio(delta("itl_sum"), delta("itl_count"), 1000.0),
        e2e_ms=_ratio(delta("e2e_sum"), delta("e2e_count"), 1000.0),
        queue_ms=_ratio(delta("queue_sum"), delta("queue_count"), 1000.0),
    )  # fmt: skip


def engine_queue_delay(a: Sample, b: Sample) -> float | None:
    """Seconds requests waited in an upstream engine's queue between two samples: the mean
    of those it scheduled, or — none scheduled while some wait — at least the whole span."""
    point = span_point(a, b)
    if point.queue_ms is not None:
        return point.queue_ms / 1000.0
    if not b.values:
        return None  # the scrape failed
    return b.t - a.t if (point.waiting or 0) > 0 else 0.0


class StatusSampler:
    """Scrapes the upstreams and the gateway's counters into ring buffers. An upstream is a
    replica's address (an OpenAI server), or a model on a Triton replica (`upstream_key`)."""

    def __init__(self, router: Router, metrics: GatewayMetrics, placement: GatewayPlacement | None = None,
                 interval_s: float = INTERVAL_S, history: int = HISTORY, triton: TritonClients | None = None,
                 stuck_after_s: float = 30.0, saturated_after_s: float = 5.0):  # fmt: skip
        self.router, self.metrics, self.placement = router, metrics, placement
        self.interval_s = interval_s
        self.triton = triton
        self.stuck_after_s, self.saturated_after_s = stuck_after_s, saturated_after_s
        replicas = router.all_replicas()
        self.urls = sorted({self.upstream_key(r) for r in replicas})
        # OpenAI servers' /metrics, and Triton models' (only chat models answer: embed and rerank have none)
        self.scraped_urls = sorted({r.url for r in replicas if router.config.models[r.alias].kind == "openai"})
        self.triton_models = sorted({(r.url, self._model(r)) for r in replicas
                                     if router.config.models[r.alias].kind == "triton"} if triton else set())  # fmt: skip
        self.upstreams: dict[str, deque[Sample]] = {u: deque(maxlen=history) for u in self.urls}
        self.last_answer: dict[str, Sample] = {}  # the last scrape that answered, however old
        self.pages: dict[str, tuple[float, str]] = {}  # a Triton chat model's latest metrics page (time, text)
        self.gateway: deque[tuple[float, dict[str, float]]] = deque(maxlen=history)  # (t, requests by alias)

    def _model(self, replica: Replica) -> str:
        return self.router.config.models[replica.alias].model or replica.alias

    def upstream_key(self, replica: Replica) -> str:
        """What the sampler keys an upstream by: an OpenAI server's address; a Triton model's URL."""
        if self.router.config.models[replica.alias].kind == "triton":
            return _triton_key(replica.url, self._model(replica))
        return replica.url

    async def scrape(self, client: httpx.AsyncClient, url: str) -> Sample:
        try:
            resp = await client.get(f"{url}/metrics")
            resp.raise_for_status()
            return parse_metrics(resp.text)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError):
            return Sample(time.time(), {})

    async def scrape_triton(self, url: str, model: str) -> Sample:
        """A Triton chat model's engine metrics (its `/metrics` endpoint); nothing from a model
        that is not a chat model."""
        key = _triton_key(url, model)
        try:
            if "request" not in await self.triton.inputs(url, model):
                return Sample(time.time(), {})
            timeout = max(2 * self.interval_s, 2.0)
            answers = [a async for a in self.triton.events(url, model, "", "/metrics", timeout)]
            status, text = answers[-1] if answers else (0, "")
        except Exception:  # noqa: BLE001 - unreachable, loading, dead: no sample this time
            return Sample(time.time(), {})
        if status != 200 or not text.startswith("#"):
            return Sample(time.time(), {})
        sample = parse_metrics(text)
        self.pages[key] = (sample.t, text)
        return sample

    async def sample_once(self, client: httpx.AsyncClient) -> None:
        samples = await asyncio.gather(*(self.scrape(client, u) for u in self.scraped_urls),
                                       *(self.scrape_triton(u, m) for u, m in self.triton_models))  # fmt: skip
        keys = [*self.scraped_urls, *(_triton_key(u, m) for u, m in self.triton_models)]
        for key, sample in zip(keys, samples):
            self.upstreams[key].append(sample)
            if sample.values:
                self.last_answer[key] = sample
        by_alias: dict[str, float] = {}
        for s in self.metrics.requests.collect()[0].samples:
            if s.name.endswith("_total"):
                by_alias[s.labels["alias"]] = by_alias.get(s.labels["alias"], 0.0) + s.value
        self.gateway.append((time.time(), by_alias))

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=max(self.interval_s, 1.0)) as client:
            while True:
                try:
                    await self.sample_once(client)
                except Exception:  # a sampler that died would freeze the page: log, keep sampling
                    logger.exception("status page: sampling failed")
                await asyncio.sleep(self.interval_s)

    def fresh_pages(self) -> list[str]:
        """The Triton chat models' metrics pages of the last few seconds (a model that stopped
        answering has its series gone, not frozen)."""
        now = time.time()
        return [text for t, text in self.pages.values() if now - t <= 3 * self.interval_s + 2.0]

    def engine_states(self) -> dict[str, dict[str, EngineState]]:
        """Each alias's engines that answer with metrics: their state, by replica address."""
        states: dict[str, dict[str, EngineState]] = {}
        for replica in self.router.all_replicas():
            key = self.upstream_key(replica)
            state = engine_state(list(self.upstreams.get(key, ())), self.stuck_after_s, self.saturated_after_s,
                                 self.last_answer.get(key))  # fmt: skip
            if state is not None:
                states.setdefault(replica.alias, {})[replica.url] = state
        return states

    def _requests_per_s(self, alias: str | None) -> float | None:
        if len(self.gateway) < 2:
            return None
        (t0, a), (t1, b) = self.gateway[max(0, len(self.gateway) - 1 - LATEST_SPAN)], self.gateway[-1]
        if alias is None:
            return _ratio(sum(b.values()) - sum(a.values()), t1 - t0)
        return _ratio(b.get(alias, 0.0) - a.get(alias, 0.0), t1 - t0)

    def engine_delay(self, alias: str) -> float:
        """The queueing delay in the engines behind `alias` over the last few seconds: the
        smallest over its healthy replicas (the router sends to the least busy), 0 when
        nothing is known. Admission sheds by it as by the gateway's own queue."""
        delays = []
        for replica in self.router.replicas.get(alias, []):
            samples = self.upstreams.get(self.upstream_key(replica))
            if not replica.healthy or not samples or len(samples) < 2:
                continue
            delay = engine_queue_delay(samples[max(0, len(samples) - 1 - LATEST_SPAN)], samples[-1])
            if delay is not None:
                delays.append(delay)
        return min(delays) if delays else 0.0

    def _upstream(self, url: str) -> UpstreamStatus:
        samples = list(self.upstreams[url])
        replicas = [r for r in self.router.all_replicas() if self.upstream_key(r) == url]
        series = [span_point(a, b) for a, b in itertools.pairwise(samples)]
        latest = span_point(samples[max(0, len(samples) - 1 - LATEST_SPAN)], samples[-1]) if len(samples) > 1 else None
        return UpstreamStatus(
            url=url, aliases=sorted({r.alias for r in replicas}),
            model=next((s.model for s in reversed(samples) if s.model), None),
            healthy=all(r.healthy for r in replicas), has_metrics=url in self.scraped_urls or url in self.last_answer,
            scraped=bool(samples and samples[-1].values),
            outstanding=sum(r.outstanding for r in replicas), latest=latest, series=series,
        )  # fmt: skip

    def data(self) -> DashboardData:
        upstreams = {u: self._upstream(u) for u in self.urls}
        placement = self.placement.snapshot() if self.placement is not None else None
        states = {m["model"]: m["state"] for m in (placement or {}).get("models", []) if isinstance(m, dict)}
        models = []
        for alias, replicas in self.router.replicas.items():
            keys = [self.upstream_key(r) for r in replicas]
            latest = [upstreams[k].latest for k in keys if upstreams[k].latest]
            kv = [p.kv_usage for p in latest if p.kv_usage is not None]
            models.append(ModelStatus(
                alias=alias, replicas=[r.url for r in replicas],
                healthy_replicas=sum(r.healthy for r in replicas),
                requests_per_s=self._requests_per_s(alias),
                running=sum(p.running or 0.0 for p in latest), waiting=sum(p.waiting or 0.0 for p in latest),
                kv_usage=max(kv) if kv else None, tokens_per_s=round(sum(p.tokens_per_s or 0.0 for p in latest), 3),
                placement=states.get(alias),
            ))  # fmt: skip
        rejections = {s.labels["reason"]: s.value for s in self.metrics.rejections.collect()[0].samples
                      if s.name.endswith("_total")}  # fmt: skip
        return DashboardData(
            time=time.time(), interval_s=self.interval_s, window_s=self.interval_s * (self.gateway.maxlen or 0),
            requests_per_s=self._requests_per_s(None), rejections=rejections, models=models,
            upstreams=list(upstreams.values()), placement=placement,
        )  # fmt: skip


def _triton_key(url: str, model: str) -> str:
    return f"{url}/v2/models/{model}"
