"""The gateway as one object: built from its config, it holds every part a request meets
(keys, limits, admission, router, upstream clients, placement, the status sampler) and runs
their background work while it is `running()`. routes.py puts HTTP in front of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import httpx
from prometheus_client import generate_latest

from llmserve.gateway.adapters import AdapterHoldings
from llmserve.gateway.admission import Admission
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.context import RequestContext, log_access
from llmserve.gateway.dashboard import StatusSampler
from llmserve.gateway.engine_state import STATES
from llmserve.gateway.keys import KeyStore
from llmserve.gateway.kv_routing import KVRouting
from llmserve.gateway.limits import build_limiter
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.metrics_pages import merged_pages
from llmserve.gateway.placement import GatewayPlacement
from llmserve.gateway.router import Replica, Router, health_loop
from llmserve.gateway.triton_upstream import TritonClients
from llmserve.responses.service import Responses
from llmserve.responses.storage import open_store
from llmserve.responses.store import default_store_path


@dataclass
class Health:
    """The body of GET /health."""

    # "ok"; "saturated" when an engine's queue has held requests for a while; "degraded" when an
    # alias has no healthy replica or an engine is stuck
    status: str
    upstreams: dict[str, bool]  # address -> healthy only if every alias it serves is
    models: dict[str, dict[str, bool]]  # alias -> replica address -> healthy
    placement: dict | None = None  # each placed model's state (resident, asleep, waking, sleeping)
    # alias -> replica address -> its engine's state (engine_state.py), where its metrics are read
    engines: dict[str, dict[str, dict]] | None = None
    # kv_aware routes: alias -> its tokenizer loaded, and replica address -> its KV event stream (live
    # or why not, blocks per medium)
    kv_events: dict[str, dict[str, dict]] | None = None

    def body(self) -> dict:
        body = {"status": self.status, "upstreams": self.upstreams, "models": self.models}
        if self.engines:
            body["engines"] = self.engines
        if self.kv_events:
            body["kv_events"] = self.kv_events
        if self.placement is not None:
            body["placement"] = self.placement
        return body


def _store_opener(config: GatewayConfig):
    """Opens the gateway's responses store (its own file by default: not a server's on this host; or a
    Postgres URL)."""
    settings = config.responses
    path = settings.store or default_store_path().with_name("gateway-responses.sqlite")
    max_age_s = settings.max_age_days * 86400 if settings.max_age_days else None
    return lambda: open_store(path, settings.max_count or None, max_age_s)


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.keys = KeyStore(config.keys)
        self.limiter = build_limiter(config.keys, config.limits)
        self.adapters = AdapterHoldings()  # LoRA adapters on the replicas of routes with `lora`
        self.metrics = GatewayMetrics()
        # routes with routing kv_aware: the replicas' KV event streams, the index, the tokenizers
        self.kv = KVRouting(config, self.metrics) if any(r.routing == "kv_aware" for r in config.models.values()) \
            else None  # fmt: skip
        self.router = Router(config, self.adapters, self.kv)
        self.triton = TritonClients(
            config.upstream_timeout_s, config.request_timeout_s
        )  # gRPC clients of Triton replicas, opened on first use
        # several chat models on one GPU: requests wait for their model to wake
        self.placement = None if config.placement is None else \
            GatewayPlacement(config.placement, config, self.triton, self.metrics)  # fmt: skip
        self.sampler = StatusSampler(self.router, self.metrics, self.placement, triton=self.triton,
                                     stuck_after_s=config.engine_stuck_after_s,
                                     saturated_after_s=config.engine_saturated_after_s)  # fmt: skip
        # admission sheds by the engines' queues (the sampler's scrapes) as by its own
        self.admission = Admission(config.admission, [k.priority for k in config.keys], self.sampler)
        # the Responses API over the chat routes (gateway/responses.py): its store opened on first use
        self.responses = Responses(_store_opener(config), request_timeout_s=config.request_timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it runs on, while running
        self.client: httpx.AsyncClient | None = None  # health checks; opened while running
        self.session: aiohttp.ClientSession | None = None  # requests upstream (the hot path); ditto
        for r in self.router.all_replicas():
            self.on_health(r)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Open the upstream clients and run the health checks, the placement and the sampler
        (the app's lifespan); everything is closed again on the way out."""
        config = self.config
        timeout = httpx.Timeout(config.upstream_timeout_s, connect=2.0)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        upstream = aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=config.upstream_timeout_s)
        connector = aiohttp.TCPConnector(limit=1000, keepalive_timeout=30)
        async with (
            httpx.AsyncClient(timeout=timeout, limits=limits) as client,
            aiohttp.ClientSession(connector=connector, timeout=upstream, auto_decompress=False) as session,
        ):
            self.client, self.session = client, session
            self._loop = asyncio.get_running_loop()
            checker = asyncio.create_task(health_loop(self.router, config.health, self.probe, self.on_health))
            placing = asyncio.create_task(self.placement.run()) if self.placement is not None else None
            sampling = asyncio.create_task(self.sampler.run())
            kv_events = asyncio.create_task(self.kv.run(client)) if self.kv is not None else None
            try:
                yield
            finally:
                self._loop = None  # the watchdog's calls from now on do nothing
                sampling.cancel()
                if kv_events is not None:
                    kv_events.cancel()
                    await asyncio.gather(kv_events, return_exceptions=True)  # (its sockets closed)
                checker.cancel()
                if placing is not None:
                    placing.cancel()
                    await self.placement.close()
                await self.responses.close()  # background responses stopped (stored as cancelled) first
                await self.limiter.close()
                await self.triton.close()

    # -- replicas --------------------------------------------------------------------------
    async def probe(self, replica: Replica) -> bool:
        """A replica is up: its /health answers 200 (OpenAI servers), its model is ready (Triton)."""
        route = self.config.models[replica.alias]
        timeout = self.config.health.timeout_s
        if route.kind == "triton":
            return await self.triton.ready(replica.url, route.model or replica.alias, timeout)
        try:
            up = (await self.client.get(f"{replica.url}/health", timeout=timeout)).status_code == 200
            if up and route.lora is not None:  # which adapters it holds now (loaded, unloaded, restarted)
                models = await self.client.get(f"{replica.url}/v1/models", timeout=timeout)
                self.adapters.seen(replica.url, models.json())
            return up
        except (httpx.HTTPError, ValueError):
            return False

    def triton_backend_died(self, url: str, model: str) -> None:
        """From another thread (`llmserve up`'s watchdog): the Triton model's backend on `url`
        died; the calls waiting on it end (a request not yet answered is retried)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutting down)
                self._loop.call_soon_threadsafe(self.triton.backend_died, url, model)

    def placed_asleep(self, url: str, model: str) -> bool | None:
        """From another thread: whether placement holds Triton model `model` on `url` asleep
        (None: it does not place it, or is not running)."""
        if self.placement is None:
            return None
        aliases = self.placement.aliases_of(url, model)
        return self.placement.held_asleep(aliases[0]) if aliases else None

    def triton_backend_restarted(self, url: str, model: str) -> None:
        """From another thread (the watchdog): the model's backend is back, awake; placement
        puts it to sleep again if it holds it asleep."""
        if self._loop is None or self.placement is None:
            return
        for alias in self.placement.aliases_of(url, model):
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutting down)
                asyncio.run_coroutine_threadsafe(self.placement.backend_restarted(alias), self._loop)

    def on_health(self, replica: Replica) -> None:
        self.metrics.upstream_healthy.labels(replica.alias, replica.url).set(1 if replica.healthy else 0)

    def health(self) -> Health:
        """Each replica's health per alias (aliases may share one Triton server), and each address's."""
        models: dict[str, dict[str, bool]] = {}
        for r in self.router.all_replicas():
            models.setdefault(r.alias, {})[r.url] = r.healthy
        upstreams: dict[str, bool] = {}
        for replicas in models.values():
            for url, ok in replicas.items():
                upstreams[url] = upstreams.get(url, True) and ok
        engines = self.sampler.engine_states()
        states = {e.state for replicas in engines.values() for e in replicas.values()}
        if not all(any(replicas.values()) for replicas in models.values()) or "stuck" in states:
            status = "degraded"
        else:
            status = "saturated" if "saturated" in states else "ok"
        placement = self.placement.snapshot() if self.placement is not None else None
        bodies = {alias: {url: e.body() for url, e in replicas.items()} for alias, replicas in engines.items()}
        return Health(status, upstreams, models, placement, bodies, self.kv.snapshot() if self.kv else None)

    def metrics_page(self) -> bytes:
        """The Prometheus page, its gauges set from the live counts first."""
        for r in self.router.all_replicas():
            self.metrics.outstanding.labels(r.alias, r.url).set(r.outstanding)
        self.metrics.in_flight.set(self.admission.in_flight)
        self.metrics.queue_waiting.set(self.admission.waiting())
        self.metrics.queueing_delay.set(self.admission.queueing_delay())
        if self.placement is not None:
            self.placement.export()
        if self.kv is not None:
            self.metrics.kv_blocks.clear()
            for alias, route in self.kv.snapshot().items():
                for url, stream in route["replicas"].items():
                    self.metrics.kv_stream_live.labels(alias, url).set(1 if stream["live"] else 0)
                    for medium, count in stream["blocks"].items():
                        self.metrics.kv_blocks.labels(alias, url, medium).set(count)
        self.metrics.engine_state.clear()
        for alias, replicas in self.sampler.engine_states().items():
            for url, engine in replicas.items():
                for state in STATES:
                    self.metrics.engine_state.labels(alias, url, state).set(1 if engine.state == state else 0)
        # the Triton chat models' engine metrics (vLLM's names), which Prometheus cannot scrape
        # itself: Triton listens on this host only
        return generate_latest(self.metrics.registry) + merged_pages(self.sampler.fresh_pages())

    # -- requests --------------------------------------------------------------------------
    def release(self, ctx: RequestContext) -> None:
        """Free what a request holds: its admission slot, and its place on a placed model."""
        if ctx.slot is not None:
            ctx.slot.release()
        if ctx.placed and self.placement is not None:
            ctx.placed = False
            self.placement.release(ctx.alias)

    async def give_back(self, ctx: RequestContext) -> None:
        """`release`, and settle the token reservation with what was used (nothing, if refused)."""
        self.release(ctx)
        if ctx.key is not None:
            await self.limiter.settle(ctx.key.name, ctx.reserved_tokens, ctx.used_tokens)

    def count_tokens(self, ctx: RequestContext) -> None:
        """The answer's usage by kind: prompt, completion and, of those, reasoning tokens (chat's
        `completion_tokens_details.reasoning_tokens`)."""
        usage, key = ctx.usage, ctx.key.name if ctx.key else ""
        details = usage.get("completion_tokens_details")
        counts = {"prompt": usage.get("prompt_tokens"), "completion": usage.get("completion_tokens"),
                  "reasoning": details.get("reasoning_tokens") if isinstance(details, dict) else None}  # fmt: skip
        for kind, count in counts.items():
            if isinstance(count, int) and count > 0:
                self.metrics.tokens.labels(ctx.alias, key, kind).inc(count)

    async def finish(self, ctx: RequestContext, status: int) -> None:
        """A request is over: `give_back` what it held, and count it."""
        await self.give_back(ctx)
        self.metrics.requests.labels(ctx.alias, str(status)).inc()
        if ctx.usage is not None:
            self.count_tokens(ctx)
        latency = time.monotonic() - ctx.started
        self.metrics.latency.labels(ctx.alias).observe(latency)
        log_access(ctx.request_id, status, alias=ctx.alias, key=ctx.key.name if ctx.key else None,
                   served_by=ctx.served_by, latency_ms=round(latency * 1000, 1), tokens=ctx.used_tokens)  # fmt: skip
