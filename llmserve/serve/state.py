"""The server's typed state, and the checks every endpoint shares."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from llmserve.engine.protocol import EngineClient
from llmserve.http_limits import DEFAULT_MAX_BODY_BYTES
from llmserve.lora_request import LoRARequest
from llmserve.metrics import EngineMetrics
from llmserve.openai.errors import APIError, engine_dead

T = TypeVar("T")


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_path: str
    api_key: str | list[str] | None = None  # several: any of them (each its own stored responses)
    admin_api_key: str | None = None  # set: admin routes (sleep, wake) need it instead of api_key
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # 413 above
    max_queued_requests: int | None = None  # 503 above this many unfinished requests
    request_timeout_s: float | None = None  # set: no completion or chat request runs longer (openai/deadline.py)
    tool_call_parser: str | None = None  # set: tool_choice "auto" is served (serve/tools.py)
    reasoning_parser: str | None = None  # set: the thoughts come apart from the answer (llmserve/reasoning)
    request_timing_log: str | None = None  # set: one JSON line per finished request (serve/timing_log.py)
    enable_sleep_mode: bool = False  # POST /sleep, POST /wake_up, GET /is_sleeping (vLLM's routes)
    enable_lora: bool = False  # adapters named as models
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> PEFT folder, served from the start
    # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (admin routes; serve/lora_routes.py)
    enable_runtime_lora_updating: bool = False
    # set: /v1/load_lora_adapter takes only folders inside these (resolved; symlinks and .. resolved first)
    lora_roots: list[str] = field(default_factory=list)
    # the Responses API's store (llmserve/responses/store.py): its SQLite file (None: the user's cache
    # folder) and its retention (None: no limit)
    responses_store: str | None = None
    responses_max_count: int | None = 10_000
    responses_max_age_s: float | None = 30 * 86400.0


@dataclass
class ServerState:
    config: ServerConfig
    engine: EngineClient | None = None
    metrics: EngineMetrics | None = None
    startup_error: str | None = None
    draining: bool = False
    adapters: dict[str, LoRARequest] = field(default_factory=dict)  # LoRA adapters served, by name
    lora_ids: int = 0  # the last adapter id given

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.engine.errored and not self.draining

    def require_engine(self) -> EngineClient:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine is None:
            why = self.startup_error or "the model is still loading"
            raise APIError(503, f"the server is not ready: {why}", code="not_ready")
        if self.engine.errored:
            raise engine_dead()
        limit = self.config.max_queued_requests
        if limit is not None and self.engine.num_unfinished >= limit:
            raise APIError(503, "the server is overloaded: too many requests in flight", code="overloaded")
        return self.engine

    def resolve_model(self, requested: str | None) -> str:
        if requested is not None and requested in self.adapters:
            return requested
        return resolve_model(self.config, requested)

    def adapter(self, model: str) -> LoRARequest | None:
        """The LoRA adapter a (resolved) model name means; None for the base model."""
        return self.adapters.get(model)

    def add_adapter(self, name: str, path: str, roots: tuple[str, ...] = ()) -> LoRARequest:
        self.lora_ids += 1
        self.adapters[name] = LoRARequest(name, self.lora_ids, path, roots)
        return self.adapters[name]


def resolve_model(config: ServerConfig, requested: str | None) -> str:
    """The served name a request asks for (the first when it names none); 404 otherwise."""
    names = config.served_model_names
    if not requested:
        return names[0]
    if requested not in names:
        raise APIError(404, f"The model `{requested}` does not exist.", code="model_not_found", param="model")
    return requested


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def check_api_key(state: ServerState, request: Request) -> None:
    _check_bearer(request, state.config.api_key, "API key")


def check_admin_key(state: ServerState, request: Request) -> None:
    """Admin routes (sleep, wake): the admin key when one is set, else the API key."""
    if state.config.admin_api_key is not None:
        _check_bearer(request, state.config.admin_api_key, "admin API key")
    else:
        check_api_key(state, request)


def bearer_token(request: Request) -> str | None:
    """The request's `Authorization: Bearer` token, if it has one."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _check_bearer(request: Request, key: str | list[str] | None, what: str) -> None:
    """401 unless the request carries `key` (or one of the keys) as a bearer token (compared in
    constant time)."""
    if key is None:
        return
    token = (bearer_token(request) or "").encode()
    # every key compared (no early exit): the time taken says nothing of which one matched
    matches = [hmac.compare_digest(token, k.encode()) for k in ([key] if isinstance(key, str) else key)]
    if bearer_token(request) is None or not any(matches):
        raise APIError(401, f"invalid or missing {what}: send 'Authorization: Bearer <key>'", code="invalid_api_key")


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first (its request is aborted)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
