"""The server's typed state, and the checks every endpoint shares."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from llmserve.engine.protocol import EngineClient
from llmserve.metrics import EngineMetrics
from llmserve.outputs import RequestOutput
from llmserve.openai.errors import APIError

T = TypeVar("T")


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_path: str
    api_key: str | None = None
    max_queued_requests: int | None = None  # 503 above this many unfinished requests
    tool_call_parser: str | None = None  # set: tool_choice "auto" is served (serve/tools.py)
    request_timing_log: str | None = None  # set: one JSON line per finished request (serve/timing_log.py)


@dataclass
class ServerState:
    config: ServerConfig
    engine: EngineClient | None = None
    metrics: EngineMetrics | None = None
    startup_error: str | None = None
    draining: bool = False

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
            raise APIError(503, "the engine is not running", code="engine_dead")
        limit = self.config.max_queued_requests
        if limit is not None and self.engine.num_unfinished >= limit:
            raise APIError(503, "the server is overloaded: too many requests in flight", code="overloaded")
        return self.engine

    def resolve_model(self, requested: str | None) -> str:
        return resolve_model(self.config, requested)


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
    key = state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int) -> int | None:
    """OpenAI semantics: prompt plus requested completion must fit in the context."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens. Please shorten the prompt.",
            code="context_length_exceeded",
        )
    if requested is not None and requested < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if requested is not None and prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce the prompt or max_tokens.",
            code="context_length_exceeded",
            param="max_tokens",
        )
    return requested


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


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generate() streams, tagging each output with its stream index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # each stream's own cleanup aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)
