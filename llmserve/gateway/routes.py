"""Every HTTP route of the gateway, over one `Gateway`: the proxied POST routes (`proxy_route`:
the checks of intake.py in order, then the proxy), and the rest (`api_router`): /v1/models,
/health, /version, /metrics, the status page.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmserve import __version__
from llmserve.gateway.context import RequestContext, log_access
from llmserve.gateway.dashboard import PAGE
from llmserve.gateway.disconnect import ClientLeft, unless_client_leaves
from llmserve.gateway.gateway import Gateway
from llmserve.gateway.intake import (
    GENERATION_PATHS,
    Rejected,
    admit,
    caller,
    read_body,
    reject_response,
    take_slot,
    wait_for_model,
)
from llmserve.gateway.keys import may_call
from llmserve.gateway.proxy import NoUpstream, forward
from llmserve.openai.errors import error_body
from llmserve.openai.protocol import ModelCard

PROXIED_PATHS = (*GENERATION_PATHS, "/v1/embeddings", "/v1/rerank")

ProxyRoute = Callable[[Request, str], Awaitable[Response]]


async def _unless_disconnected(request: Request, gateway: Gateway, ctx: RequestContext) -> Response:
    """Forward, but a client that leaves before the response is ready cancels the upstream call:
    closing its connection makes the upstream abort the request and free its KV blocks."""
    try:
        return await unless_client_leaves(forward(gateway, ctx), request)
    except ClientLeft:
        ctx.used_tokens = ctx.reserved_tokens  # what was generated before the abort is unknown: kept
        await gateway.finish(ctx, 499)
        return Response(status_code=499)  # nobody is listening


def proxy_route(gateway: Gateway) -> ProxyRoute:
    """The handler of the proxied POST routes (`PROXIED_PATHS`), called with the path."""
    config = gateway.config

    async def handle(request: Request, path: str) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
            ctx = await admit(gateway, request, body, path, request_id)
            await take_slot(gateway, ctx, request)
            await wait_for_model(gateway, ctx, request)
        except Rejected as exc:
            gateway.metrics.rejections.labels(exc.reason).inc()
            log_access(request_id, exc.status, rejected=exc.reason)
            return reject_response(exc, request_id)
        except ClientLeft:  # while it waited for a slot: its queue place is free again, its tokens back
            await gateway.finish(ctx, 499)
            return Response(status_code=499)
        try:
            return await _unless_disconnected(request, gateway, ctx)
        except NoUpstream:
            await gateway.finish(ctx, 503)
            gateway.metrics.rejections.labels("no_healthy_upstream").inc()
            exc = Rejected(503, "no_healthy_upstream", f"no replica of {ctx.alias!r} can take the request", 1)
            return reject_response(exc, request_id)
        except BaseException:
            gateway.release(ctx)
            raise

    return handle


def _card(alias: str, created: int) -> dict:
    """A model card as OpenAI's /v1/models gives it (`created`: when the gateway started)."""
    return ModelCard(id=alias, created=created).model_dump(exclude_none=True)


def api_router(gateway: Gateway) -> APIRouter:
    """The routes that are not proxied: models, health, version, metrics, the status page."""
    config = gateway.config
    router = APIRouter()
    created = int(time.time())

    @router.get("/version")
    async def version() -> dict:
        """As `llmserve serve` answers it."""
        return {"version": __version__}

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            key = caller(gateway, request)
        except Rejected as exc:
            return reject_response(exc, "")
        cards = [_card(a, created) for a in config.models if key is None or may_call(key, a)]
        return JSONResponse({"object": "list", "data": cards})

    @router.get("/v1/models/{alias:path}")
    async def model(alias: str, request: Request) -> Response:
        try:
            key = caller(gateway, request)
            if alias not in config.models or (key is not None and not may_call(key, alias)):
                raise Rejected(404, "model_not_found", f"the model {alias[:100]!r} does not exist")
        except Rejected as exc:
            return reject_response(exc, "")
        return JSONResponse(_card(alias, created))

    @router.get("/health")
    async def health() -> Response:
        """Each replica's health per alias (`models`; aliases may share one Triton server), each
        address's (`upstreams`: healthy only if every alias it serves is); "ok" when every
        alias has a healthy replica, else "degraded"; placed models' states (`placement`)."""
        return JSONResponse(gateway.health().body())

    def exposed(setting: str, request: Request) -> Response | None:
        """None when the caller may read the page (`expose:`), else the refusal."""
        if setting == "off":
            return JSONResponse(error_body(404, f"{request.url.path} is not served here", code="not_found"),
                                status_code=404)  # fmt: skip
        if setting == "keyed":  # as the API's routes check a key (`keyed` needs keys: config.py)
            try:
                caller(gateway, request)
            except Rejected as exc:
                return reject_response(exc, "")
        return None

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        refused = exposed(config.expose.metrics, request)
        return refused or Response(gateway.metrics_page(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def page(request: Request) -> Response:
        refused = exposed(config.expose.dashboard, request)
        return refused or HTMLResponse(PAGE.read_text(), headers={"cache-control": "no-store"})

    @router.get("/dashboard/data")
    async def data(request: Request) -> Response:
        refused = exposed(config.expose.dashboard, request)
        return refused or JSONResponse(asdict(gateway.sampler.data()), headers={"cache-control": "no-store"})

    return router
