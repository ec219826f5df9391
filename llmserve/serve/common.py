"""What the generation server and the embedding server share: a model that loads in the
background while the app already answers, and the routes every server has (/health,
/version, /metrics, /v1/models)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmserve import __version__
from llmserve.lora_request import LoRARequest
from llmserve.openai.errors import APIError
from llmserve.openai.protocol import ModelCard, ModelList
from llmserve.serve.state import ServerConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


class LoadingState(Protocol):
    startup_error: str | None  # why the model could not load
    draining: bool  # shutting down: refuse new work


def background_loader(
    factory: Callable[[], T],
    what: str,
    state: LoadingState,
    loaded: Callable[[T], None],
    on_fatal: Callable[[str], None] | None,
    stop: Callable[[], Awaitable[None]],
):
    """A FastAPI lifespan: `factory` runs in a thread while the app serves; its result goes
    to `loaded`, or why it failed ("<what> failed to start: ...") to `state.startup_error`
    and `on_fatal`. On shutdown: `state.draining`, the load cancelled if still running,
    then `stop()`."""

    async def load() -> None:
        try:
            result = await asyncio.to_thread(factory)
        except Exception as exc:  # noqa: BLE001 - reported by /health and every endpoint
            state.startup_error = f"{what} failed to start: {exc}"
            logger.error(state.startup_error)
            if on_fatal is not None:
                on_fatal(state.startup_error)
            return
        loaded(result)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(load())
        try:
            yield
        finally:
            state.draining = True
            loader.cancel()
            await stop()

    return lifespan


def add_common_routes(
    app: FastAPI,
    config: ServerConfig,
    not_ready: Callable[[], str | None],
    registry: Callable[[], CollectorRegistry | None],
    max_model_len: Callable[[], int | None],
    authorized: Callable[..., Any],
    adapters: Callable[[], dict[str, LoRARequest]] = dict,
) -> None:
    """/health (200, or 503 with why: `not_ready()` says it, None when ready), /version,
    /metrics (the `registry()`, empty before there is one) and /v1/models (behind the
    API key: `authorized` is the app's dependency that checks it)."""

    @app.get("/health")
    async def health() -> Response:
        if (why := not_ready()) is not None:
            raise APIError(503, why, code="not_ready")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        reg = registry()
        return Response(generate_latest(reg) if reg is not None else b"", media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> ModelCard:
        lora = adapters().get(name)
        if lora is not None:  # a LoRA adapter: its folder, and the base model it runs on
            return ModelCard(id=name, root=lora.lora_path, parent=config.served_model_names[0],
                             max_model_len=max_model_len())  # fmt: skip
        return ModelCard(id=name, root=config.model_path, max_model_len=max_model_len())

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(authorized)])
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in [*config.served_model_names, *adapters()]])

    @app.get("/v1/models/{name:path}", response_model=ModelCard, dependencies=[Depends(authorized)])
    async def model(name: str) -> ModelCard:
        """One model card (OpenAI's retrieve-model call)."""
        if name not in config.served_model_names and name not in adapters():
            raise APIError(404, f"the model {name[:100]!r} does not exist", code="model_not_found", param="model")
        return card(name)
