"""The gateway's HTTP surface: checks run in order (size, key, model, limits), then the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import uuid

import aiohttp
import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve.gateway.admission import Refused
from llmserve.gateway.affinity import prefix_key
from llmserve.gateway.config import ApiKey, GatewayConfig
from llmserve.gateway.dashboard import dashboard_router
from llmserve.gateway.keys import may_call
from llmserve.gateway.limits import LimitExceeded, LimitsUnavailable, OverCapacity
from llmserve.gateway.placement import WakeTimeout
from llmserve.gateway.proxy import NoUpstream, forward
from llmserve.gateway.router import Replica, health_loop
from llmserve.gateway.state import GatewayState, RequestContext, log_access
from llmserve.heap import freeze_startup_objects
from llmserve.openai.errors import error_body
from llmserve.http_errors import install_error_handlers
from llmserve.openai.text_checks import LONE_SURROGATE, has_lone_surrogate

PROXIED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class Rejected(Exception):
    """A request refused before it reaches any upstream."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after


def _reject_response(exc: Rejected, request_id: str) -> JSONResponse:
    headers = {"x-request-id": request_id}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))  # whole seconds, never 0
    return JSONResponse(error_body(exc.status, exc.message, code=exc.reason), status_code=exc.status, headers=headers)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Rejected(413, "body_too_large", f"the request body is over {limit} bytes")
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):  # a client trickling its body would hold a slot forever
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise Rejected(413, "body_too_large", f"the request body is over {limit} bytes")
    except TimeoutError:
        raise Rejected(408, "body_timeout", f"the request body did not arrive within {timeout_s} s") from None
    return bytes(body)


def _estimate_tokens(payload: dict, path: str, default_max_tokens: int) -> int:
    """Reserved up front: about 4 characters a prompt token, plus the most the reply may use."""
    fields = ("messages", "prompt", "input", "query", "documents")
    prompt = len(json.dumps([payload.get(f) for f in fields if f in payload])) // 4 + 1
    if path not in GENERATION_PATHS:
        return prompt  # embeddings and rerank generate nothing
    max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or default_max_tokens
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise Rejected(400, "invalid_request", "max_tokens must be a positive integer")
    return prompt + max_tokens


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _parse_body(body: bytes) -> dict:
    """The request's JSON object: strict JSON (no NaN or Infinity), nested within reason, and
    text that is valid Unicode (JSON may escape a lone surrogate, which no UTF-8 can carry)."""
    try:
        payload = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise Rejected(400, "invalid_json", "the request body is not valid JSON (or is nested too deeply)") from None
    if not isinstance(payload, dict):
        raise Rejected(400, "invalid_json", "the request body must be a JSON object")
    if has_lone_surrogate(body, payload):
        raise Rejected(400, "invalid_json", LONE_SURROGATE)
    return payload


def _caller(state: GatewayState, request: Request) -> ApiKey | None:
    """The calling key (None: an open gateway); Rejected 401 for a missing, wrong or revoked one."""
    if state.keys.open:
        return None
    key = state.keys.authenticate(request.headers.get("authorization"))
    if key is None:
        raise Rejected(401, "invalid_api_key", "missing, wrong or revoked API key")
    return key


async def _admit(state: GatewayState, request: Request, body: bytes, path: str, request_id: str) -> RequestContext:
    key = _caller(state, request)
    payload = _parse_body(body)
    alias = payload.get("model")
    if not isinstance(alias, str):
        raise Rejected(400, "invalid_request", "model is required: the name of a model (a string), see /v1/models")
    if alias not in state.config.models:
        raise Rejected(404, "model_not_found", f"the model {alias[:100]!r} does not exist")
    if key is not None and not may_call(key, alias):
        raise Rejected(403, "model_not_allowed", f"this key may not call {alias!r}")
    ctx = RequestContext(request_id, path, alias, payload, payload.get("stream") is True, key)
    ctx.reserved_tokens = _estimate_tokens(payload, path, state.config.default_max_tokens)
    if state.router.uses_affinity and path in GENERATION_PATHS:
        ctx.prefix = prefix_key(payload, state.config.models[alias].affinity_prefix_chars)
    if key is not None:
        try:
            await state.limiter.reserve(key.name, ctx.reserved_tokens)
        except OverCapacity as exc:
            raise Rejected(400, "over_token_limit", f"this request may take {exc.asked} tokens (its input and "
                           f"max_tokens), more than this key's {exc.reason} ({exc.capacity}): it can never be "
                           "admitted; lower max_tokens or send less") from None  # fmt: skip
        except LimitExceeded as exc:
            raise Rejected(429, exc.reason, f"rate limit reached ({exc.reason})", exc.retry_after) from None
        except LimitsUnavailable:
            raise Rejected(503, "limits_unavailable", "the shared rate-limit store cannot be reached", 1) from None
    return ctx


class ClientLeft(Exception):
    """The client went away before its answer was ready (waiting for a slot, or upstream)."""


async def _take_slot(state: GatewayState, ctx: RequestContext, request: Request) -> None:
    """Wait for an admission slot; refused (shed or timed out), or the client left while it
    waited: the reservation comes back (and the queue place at once)."""
    sheds = state.config.admission.target_queue_delay_ms is not None
    acquire = state.admission.acquire(ctx.priority, state.engine_delay(ctx.alias) if sheds else 0.0)
    try:
        if state.admission.would_wait():  # only a wait needs watching for a client leaving
            ctx.slot = await _unless_client_leaves(acquire, request)
        else:
            ctx.slot = await acquire
    except Refused as exc:
        if ctx.key is not None:
            await state.limiter.settle(ctx.key.name, ctx.reserved_tokens, 0)
        raise Rejected(503, exc.reason, f"the gateway is overloaded ({exc.reason}): retry later", exc.retry_after) from None


async def _wait_for_model(state: GatewayState, ctx: RequestContext, request: Request) -> None:
    """A placed model (several on one GPU) asleep: wait for its wake, bounded; then 503
    model_waking with a Retry-After (the slot and the reservation come back)."""
    placement = state.placement
    if placement is None or ctx.path not in GENERATION_PATHS or not placement.manages(ctx.alias):
        return
    try:
        if placement.resident(ctx.alias):  # the common case: nothing to wait for or watch
            ctx.placed = await placement.acquire(ctx.alias)
        else:
            ctx.placed = await _unless_client_leaves(placement.acquire(ctx.alias), request)
    except WakeTimeout as exc:
        if ctx.slot is not None:
            ctx.slot.release()
        if ctx.key is not None:
            await state.limiter.settle(ctx.key.name, ctx.reserved_tokens, 0)
        raise Rejected(503, "model_waking", f"{exc}: it is waking, retry later", exc.retry_after_s) from None


async def _unless_client_leaves(work, request: Request):
    """Await `work`, cancelled (ClientLeft) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        raise ClientLeft() from None


async def _probe(state: GatewayState, replica: Replica) -> bool:
    """A replica is up: its /health answers 200 (OpenAI servers), its model is ready (Triton)."""
    route = state.config.models[replica.alias]
    timeout = state.config.health.timeout_s
    if route.kind == "triton":
        return await state.triton.ready(replica.url, route.model or replica.alias, timeout)
    try:
        return (await state.client.get(f"{replica.url}/health", timeout=timeout)).status_code == 200
    except httpx.HTTPError:
        return False


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, state: GatewayState, ctx: RequestContext) -> Response:
    """Forward, but a client that leaves before the response is ready cancels the upstream call:
    closing its connection makes the upstream abort the request and free its KV blocks."""
    try:
        return await _unless_client_leaves(forward(state, ctx), request)
    except ClientLeft:
        ctx.used_tokens = ctx.reserved_tokens  # what was generated before the abort is unknown: kept
        await state.finish(ctx, 499)
        return Response(status_code=499)  # nobody is listening


def build_app(config: GatewayConfig) -> ProxyFirst:
    state = GatewayState(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        timeout = httpx.Timeout(config.upstream_timeout_s, connect=2.0)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        upstream = aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=config.upstream_timeout_s)
        connector = aiohttp.TCPConnector(limit=1000, keepalive_timeout=30)
        async with (
            httpx.AsyncClient(timeout=timeout, limits=limits) as client,
            aiohttp.ClientSession(connector=connector, timeout=upstream, auto_decompress=False) as session,
        ):
            state.client, state.session = client, session
            # everything imported and built so far lives as long as the process: keep it out of
            # the garbage collector's scans (a full scan of this heap stalls requests for ~1 s)
            freeze_startup_objects("gateway")
            probe = functools.partial(_probe, state)
            checker = asyncio.create_task(health_loop(state.router, config.health, probe, state.on_health))
            placing = asyncio.create_task(state.placement.run()) if state.placement is not None else None
            try:
                yield
            finally:
                checker.cancel()
                if placing is not None:
                    placing.cancel()
                    await state.placement.close()
                await state.limiter.close()
                await state.triton.close()

    app = FastAPI(title="llmserve gateway", lifespan=lifespan)
    app.state.gateway = state

    install_error_handlers(app)  # unknown paths and methods, bad query values: OpenAI's error format
    app.include_router(dashboard_router(state))  # /dashboard: the live status page

    async def handle(request: Request, path: str) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            body = await _read_body(request, config.max_body_bytes, config.body_timeout_s)
            ctx = await _admit(state, request, body, path, request_id)
            await _take_slot(state, ctx, request)
            await _wait_for_model(state, ctx, request)
        except Rejected as exc:
            state.metrics.rejections.labels(exc.reason).inc()
            log_access(request_id, exc.status, rejected=exc.reason)
            return _reject_response(exc, request_id)
        except ClientLeft:  # while it waited for a slot: its queue place is free again, its tokens back
            await state.finish(ctx, 499)
            return Response(status_code=499)
        try:
            return await _unless_disconnected(request, state, ctx)
        except NoUpstream:
            await state.finish(ctx, 503)
            state.metrics.rejections.labels("no_healthy_upstream").inc()
            exc = Rejected(503, "no_healthy_upstream", f"no replica of {ctx.alias!r} can take the request", 1)
            return _reject_response(exc, request_id)
        except BaseException:
            if ctx.slot is not None:
                ctx.slot.release()
            state.release_model(ctx)
            raise


    def card(alias: str) -> dict:
        return {"id": alias, "object": "model", "owned_by": "llmserve"}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            key = _caller(state, request)
        except Rejected as exc:
            return _reject_response(exc, "")
        return JSONResponse({"object": "list", "data": [card(a) for a in config.models if key is None or may_call(key, a)]})

    @app.get("/v1/models/{alias:path}")
    async def model(alias: str, request: Request) -> Response:
        try:
            key = _caller(state, request)
            if alias not in config.models or (key is not None and not may_call(key, alias)):
                raise Rejected(404, "model_not_found", f"the model {alias[:100]!r} does not exist")
        except Rejected as exc:
            return _reject_response(exc, "")
        return JSONResponse(card(alias))

    @app.get("/health")
    async def health() -> Response:
        """Each replica's health per alias (`models`; aliases may share one Triton server), each
        address's (`upstreams`: healthy only if every alias it serves is); "ok" when every
        alias has a healthy replica, else "degraded"."""
        models: dict[str, dict[str, bool]] = {}
        for r in state.router.all_replicas():
            models.setdefault(r.alias, {})[r.url] = r.healthy
        upstreams: dict[str, bool] = {}
        for replicas in models.values():
            for url, ok in replicas.items():
                upstreams[url] = upstreams.get(url, True) and ok
        status = "ok" if all(any(replicas.values()) for replicas in models.values()) else "degraded"
        body = {"status": status, "upstreams": upstreams, "models": models}
        if state.placement is not None:  # each placed model's state: resident, asleep, waking, sleeping
            body["placement"] = state.placement.snapshot()
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        for r in state.router.all_replicas():
            state.metrics.outstanding.labels(r.alias, r.url).set(r.outstanding)
        state.metrics.in_flight.set(state.admission.in_flight)
        state.metrics.queue_waiting.set(state.admission.waiting())
        state.metrics.queueing_delay.set(state.admission.queueing_delay())
        if state.placement is not None:
            state.placement.export()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return ProxyFirst(app, handle)


class ProxyFirst:
    """ASGI: the proxied POST routes go straight to their handler, past FastAPI's routing and
    middleware stack (the gateway's hot path); everything else goes to the FastAPI app."""

    def __init__(self, app: FastAPI, handle):
        self.app, self.handle = app, handle
        self.state = app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in PROXIED_PATHS:
            if scope["method"] == "POST":
                response = await self.handle(Request(scope, receive, send), scope["path"])
            else:
                response = JSONResponse(error_body(405, f"{scope['path']} takes POST"), status_code=405,
                                        headers={"Allow": "POST"})  # fmt: skip
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
