"""The gateway's ASGI app: config → `Gateway` → FastAPI app with the routes of routes.py, the
proxied POST routes served ahead of FastAPI's stack."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.gateway import Gateway
from llmserve.gateway.routes import PROXIED_PATHS, ProxyRoute, api_router, proxy_route
from llmserve.heap import freeze_startup_objects
from llmserve.http_errors import install_error_handlers
from llmserve.openai.errors import error_body


def build_app(config: GatewayConfig) -> ProxyFirst:
    """The app of a gateway built from `config` (its `.gateway` is the object)."""
    return gateway_app(Gateway(config))


def gateway_app(gateway: Gateway) -> ProxyFirst:
    """The app over `gateway`: its background work runs for the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async with gateway.running():
            # everything imported and built so far lives as long as the process: keep it out of
            # the garbage collector's scans (a full scan of this heap stalls requests for ~1 s)
            freeze_startup_objects("gateway")
            yield

    app = FastAPI(title="llmserve gateway", lifespan=lifespan)
    install_error_handlers(app)  # unknown paths and methods, bad query values: OpenAI's error format
    app.include_router(api_router(gateway))
    return ProxyFirst(app, gateway, proxy_route(gateway))


class ProxyFirst:
    """ASGI: the proxied POST routes go straight to their handler, past FastAPI's routing and
    middleware stack (the gateway's hot path); everything else goes to the FastAPI app."""

    def __init__(self, app: FastAPI, gateway: Gateway, handle: ProxyRoute):
        self.app, self.gateway, self.handle = app, gateway, handle

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
