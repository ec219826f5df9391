"""Sending one request upstream: pick a replica, retry only before the first byte, pass the stream through."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import anyio
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmserve.gateway.context import RequestContext
from llmserve.gateway.gateway import Gateway
from llmserve.gateway.opened import Opened, UpstreamFailed
from llmserve.gateway.router import InFlight, Pick
from llmserve.gateway.triton_upstream import open_triton
from llmserve.openai.errors import sse_error


class NoUpstream(Exception):
    """No replica of the alias (or of its fallback) can take the request."""


@functools.lru_cache(maxsize=256)
def _model_field(served: str) -> str:
    return f'"model":{json.dumps(served)}'


def _rewrite_model(line: str, served: str, ctx: RequestContext) -> str:
    """The `model` field says the alias that served; usage, when a chunk carries it, settles the
    limits. `line` may end with newlines (kept). A chunk that names `served` already and has no
    usage passes as it is (no JSON round trip: this runs for every token of every stream)."""
    if not line.startswith("data: {"):
        return line
    body = line.rstrip("\n")
    if '"usage":{' not in body and '"usage": {' not in body and _model_field(served) in body:
        return line
    try:
        chunk = json.loads(body[len("data: ") :])
    except json.JSONDecodeError:
        return line
    if isinstance(chunk, dict):
        if "model" in chunk:
            chunk["model"] = served
        if isinstance(chunk.get("usage"), dict):
            ctx.saw_usage(chunk["usage"])
    return "data: " + json.dumps(chunk, separators=(",", ":")) + line[len(body) :]


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    async for raw in response.content:
        yield raw.decode().rstrip("\r\n")


def _closer(response: aiohttp.ClientResponse):
    async def close() -> None:
        if response.content.at_eof():
            response.release()  # read to the end: the connection goes back to the pool
        else:
            response.close()  # mid-answer: dropping the connection makes the replica abort the request

    return close


async def _open_openai(gateway: Gateway, ctx: RequestContext, pick: Pick) -> Opened:
    """Send to one OpenAI-compatible replica and read up to the first byte we would pass on; a
    route's LoRA adapter is loaded there first if needed (and again if the replica dropped it)."""
    route, url = pick.route, pick.replica.url
    if route.lora_path is not None:
        await _load_adapter(gateway, pick)
    opened = await _send_openai(gateway, ctx, pick)
    if opened.status == 404 and route.lora_path is not None:  # the replica dropped the adapter since
        await opened.close()
        gateway.adapters.dropped(url, route.lora)
        await _load_adapter(gateway, pick)
        opened = await _send_openai(gateway, ctx, pick)
    return opened


async def _load_adapter(gateway: Gateway, pick: Pick) -> None:
    if await gateway.adapters.ensure_loaded(
        gateway.client, pick.route, pick.replica.url, gateway.config.upstream_timeout_s
    ):
        gateway.metrics.adapter_loads.labels(pick.alias, pick.replica.url).inc()


async def _send_openai(gateway: Gateway, ctx: RequestContext, pick: Pick) -> Opened:
    payload = dict(ctx.payload, model=pick.route.lora or pick.route.model or pick.alias)
    payload.pop("priority", None)  # a client does not pick its own priority: its key does
    if pick.route.send_priority and ctx.priority:
        payload["priority"] = -ctx.priority  # vLLM-style: lower is served first
    headers = {"content-type": "application/json", "x-request-id": ctx.request_id}
    try:
        response = await gateway.session.post(pick.replica.url + ctx.path, data=json.dumps(payload), headers=headers)
    except (aiohttp.ClientError, TimeoutError) as exc:  # refused at the door, or dropped while sending or waiting
        accepted = not isinstance(exc, aiohttp.ClientConnectorError)
        raise UpstreamFailed(str(exc) or type(exc).__name__, unavailable=True, accepted=accepted) from exc
    close = _closer(response)
    try:
        if response.status >= 500:
            content = await response.read()
            raise UpstreamFailed("upstream error", response.status, content, response.status == 503)
        if not ctx.stream or response.status != 200:
            return Opened(response.status, await response.read(), None, None, close)
        lines = _lines(response)
        first = await anext(lines)  # a replica that dies now has sent the client nothing: retry
        return Opened(200, None, lines, first, close)
    except (aiohttp.ClientError, TimeoutError, StopAsyncIteration) as exc:  # it died before answering
        response.close()
        raise UpstreamFailed(str(exc) or type(exc).__name__, unavailable=True, accepted=True) from exc
    except BaseException:
        response.close()
        raise


async def _open(gateway: Gateway, ctx: RequestContext, pick: Pick) -> Opened:
    if pick.route.kind == "triton":
        return await open_triton(gateway.triton, ctx, pick)
    return await _open_openai(gateway, ctx, pick)


async def _attempt(gateway: Gateway, ctx: RequestContext, pick: Pick) -> tuple[InFlight, Opened]:
    """Send to the picked replica, counted there while the answer is open (no longer if it failed)."""
    sent = pick.replica.send()
    try:
        return sent, await _open(gateway, ctx, pick)
    except BaseException:
        sent.end()
        raise


async def forward(gateway: Gateway, ctx: RequestContext) -> Response:
    """Send the request to a replica, the next one if it fails before the first byte. When none
    can start it because they are down (not busy), wait for one to come back for up to
    `retry_unstarted_s`, trying again with backoff: a restarting backend costs time, not the request."""
    tried: set[str] = set()
    last_error: UpstreamFailed | None = None
    accepted_failures = 0  # failures after a replica had taken it: the request may be what breaks them
    waits = Backoff(gateway.config.retry_unstarted_s)
    while True:
        pick = gateway.router.pick(ctx.alias, tried, ctx.prefix, ctx.kv_prompt)
        if pick is None:
            # down (unreachable, dead backend, every breaker open), not busy (at max_concurrency: shed now)
            down = last_error.unavailable if last_error is not None else gateway.router.all_down(ctx.alias)
            if down and accepted_failures <= 1 and await waits.wait():
                tried.clear()
                continue
            if last_error is not None and last_error.status is not None:
                return await _finish_plain(gateway, ctx, None, last_error.status, last_error.content or b"")
            raise NoUpstream(ctx.alias)
        try:
            sent, opened = await _attempt(gateway, ctx, pick)
        except UpstreamFailed as exc:
            tried.add(pick.replica.url)
            last_error = exc
            accepted_failures += exc.accepted
            if not exc.overloaded:  # overloaded (503) is not broken: no breaker count
                pick.replica.record_failure(gateway.config.health.failure_threshold)
            gateway.metrics.retries.labels(ctx.alias).inc()
            continue
        ctx.served_by = pick.alias
        gateway.metrics.routing.labels(pick.alias, pick.decision).inc()
        if pick.alias != ctx.alias:
            gateway.metrics.fallbacks.labels(ctx.alias, pick.alias).inc()
        if opened.lines is None:
            sent.end()
            await opened.close()
            return await _finish_plain(gateway, ctx, pick, opened.status, opened.content or b"")
        return _stream(gateway, ctx, pick, sent, opened)


class Backoff:
    """Pauses of 0.25 s doubling to 2 s, until `budget_s` has passed since it was made."""

    def __init__(self, budget_s: float):
        self.deadline = time.monotonic() + budget_s
        self.pause = 0.25

    async def wait(self) -> bool:
        """Sleep the next pause; False (at once) when the budget is spent."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(self.pause, left))
        self.pause = min(self.pause * 2, 2.0)
        return True


def _headers(ctx: RequestContext, pick: Pick | None) -> dict[str, str]:
    headers = {"x-request-id": ctx.request_id}
    if pick is not None:
        headers["x-llmserve-served-by"] = pick.alias
    return headers


async def _finish_plain(
    gateway: Gateway, ctx: RequestContext, pick: Pick | None, status: int, content: bytes
) -> Response:
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if status == 200 and isinstance(body, dict) and pick is not None:
        body["model"] = pick.alias
        ctx.used_tokens = ctx.reserved_tokens  # unless the body says what it used
        if isinstance(body.get("usage"), dict):
            ctx.saw_usage(body["usage"])
    else:
        ctx.used_tokens = 0  # nothing generated
    await gateway.finish(ctx, status)
    if body is None:
        return Response(content, status_code=status, headers=_headers(ctx, pick))
    return JSONResponse(body, status_code=status, headers=_headers(ctx, pick))


def _stream(gateway: Gateway, ctx: RequestContext, pick: Pick, sent: InFlight, opened: Opened) -> StreamingResponse:
    ctx.used_tokens = ctx.reserved_tokens  # kept unless a chunk reports the real usage

    async def relay() -> AsyncIterator[str]:
        status = 200
        try:
            # a line may carry the blank line that ends its event ("data: ...\n"): one write
            yield _rewrite_model(opened.first, pick.alias, ctx) + "\n"
            done = opened.first.rstrip("\n") == "data: [DONE]"
            async for line in opened.lines:
                done = done or line.rstrip("\n") == "data: [DONE]"
                yield _rewrite_model(line, pick.alias, ctx) + "\n"
            if not done:
                raise UpstreamFailed("the stream ended without [DONE]")
        except Exception as exc:  # noqa: BLE001 - the upstream broke mid-stream: too late to retry
            status = 502
            pick.replica.record_failure(gateway.config.health.failure_threshold)
            # the client learns it from a last event, as vLLM's server ends a failed stream
            yield "\n" + sse_error(502, f"the upstream failed mid-stream: {str(exc) or type(exc).__name__}")
            yield "data: [DONE]\n\n"
        except BaseException:
            status = 499  # the client left
            raise
        finally:
            sent.end()
            # closing the upstream response drops its connection, so the replica aborts the
            # request and frees its KV blocks; shielded, as this runs while being cancelled
            with anyio.CancelScope(shield=True):
                await opened.close()
                await gateway.finish(ctx, status)

    return StreamingResponse(relay(), media_type="text/event-stream", headers=_headers(ctx, pick))
