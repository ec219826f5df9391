"""The gateway's ASGI app: config → `Gateway` → FastAPI app with the routes of routes.py, the
proxied POST routes served ahead of FastAPI's stack."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.gateway import Gateway
from llmserve.gateway.intake import Rejected, reject_response
from llmserve.gateway.responses import responses_router
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
    app.include_router(responses_router(gateway))  # the Responses API over the chat routes

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected) -> JSONResponse:  # a key refused (the responses' routes)
        return reject_response(exc, request.headers.get("x-request-id") or "")

    app.openapi = lambda: openapi_with_proxied_routes(app)
    return ProxyFirst(app, gateway, proxy_route(gateway))


def openapi_with_proxied_routes(app: FastAPI) -> dict:
    """FastAPI's schema of the app, plus the proxied POST routes with their request bodies
    (ProxyFirst serves them ahead of FastAPI, so FastAPI alone would leave them out)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    from llmserve.openai.pooling_protocol import EmbeddingRequest, RerankRequest
    from llmserve.openai.protocol import ChatCompletionRequest, CompletionRequest

    bodies = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
              "/v1/embeddings": EmbeddingRequest, "/v1/rerank": RerankRequest}  # fmt: skip
    assert set(bodies) == set(PROXIED_PATHS)
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    refs, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                    ref_template="#/components/schemas/{model}")  # fmt: skip
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    answer = {"description": "the upstream's answer: JSON, or server-sent events when `stream` is true"}
    refused = {"description": "refused: OpenAI's error body"}
    for path, model in bodies.items():
        schema["paths"][path] = {"post": {
            "summary": f"proxied to the route's replicas: {model.__name__}",
            "operationId": "proxy_" + path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}},
            "responses": {"200": answer, "4XX": refused, "503": refused},
        }}  # fmt: skip
    app.openapi_schema = schema
    return schema


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
