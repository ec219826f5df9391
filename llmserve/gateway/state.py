"""What the gateway holds while it runs, and what one request carries through it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import httpx

from llmserve.gateway.admission import Admission, Slot
from llmserve.gateway.config import ApiKey, GatewayConfig
from llmserve.gateway.keys import KeyStore
from llmserve.gateway.limits import build_limiter
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.placement import GatewayPlacement
from llmserve.gateway.router import Replica, Router
from llmserve.gateway.triton_upstream import TritonClients

access_log = logging.getLogger("llmserve.gateway.access")


@dataclass
class RequestContext:
    request_id: str
    path: str  # e.g. /v1/chat/completions
    alias: str  # the model the client asked for
    payload: dict
    stream: bool
    key: ApiKey | None
    reserved_tokens: int = 0
    used_tokens: int = 0
    served_by: str | None = None  # the alias whose replica answered
    slot: Slot | None = None  # the admission slot held until the response is over
    prefix: str | None = None  # what the prompt starts with, for prefix-affinity routing
    placed: bool = False  # counted in flight by the placement (released in `finish`)
    started: float = field(default_factory=time.monotonic)

    @property
    def priority(self) -> int:
        return self.key.priority if self.key is not None else 0


class GatewayState:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.keys = KeyStore(config.keys)
        self.limiter = build_limiter(config.keys, config.limits)
        self.router = Router(config)
        self.admission = Admission(config.admission, [k.priority for k in config.keys])
        # seconds requests for an alias now wait in the upstream engines' queues (set by the
        # status sampler, which scrapes their /metrics)
        self.engine_delay: Callable[[str], float] = lambda alias: 0.0
        self.metrics = GatewayMetrics()
        self.client: httpx.AsyncClient | None = None  # health checks; opened in the app's lifespan
        self.session: aiohttp.ClientSession | None = None  # requests upstream (the hot path); ditto
        self.triton = TritonClients(config.upstream_timeout_s)  # gRPC clients of Triton replicas, opened on first use
        # several chat models on one GPU: requests wait for their model to wake
        self.placement = None if config.placement is None else \
            GatewayPlacement(config.placement, config, self.triton, self.metrics)  # fmt: skip
        for r in self.router.all_replicas():
            self.on_health(r)

    def on_health(self, replica: Replica) -> None:
        self.metrics.upstream_healthy.labels(replica.alias, replica.url).set(1 if replica.healthy else 0)

    async def finish(self, ctx: RequestContext, status: int) -> None:
        """A request is over: free its slot, settle its token reservation and count it."""
        if ctx.slot is not None:
            ctx.slot.release()
        self.release_model(ctx)
        if ctx.key is not None:
            await self.limiter.settle(ctx.key.name, ctx.reserved_tokens, ctx.used_tokens)
        self.metrics.requests.labels(ctx.alias, str(status)).inc()
        latency = time.monotonic() - ctx.started
        self.metrics.latency.labels(ctx.alias).observe(latency)
        log_access(ctx.request_id, status, alias=ctx.alias, key=ctx.key.name if ctx.key else None,
                   served_by=ctx.served_by, latency_ms=round(latency * 1000, 1), tokens=ctx.used_tokens)  # fmt: skip


    def release_model(self, ctx: RequestContext) -> None:
        if ctx.placed and self.placement is not None:
            ctx.placed = False
            self.placement.release(ctx.alias)


def log_access(request_id: str, status: int, **fields) -> None:
    """One JSON line a request, so logs can be searched by request id."""
    access_log.info(json.dumps({"request_id": request_id, "status": status, **fields}))
