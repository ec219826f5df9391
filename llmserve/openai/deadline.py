"""A request's deadline: past it, its engine requests are aborted and the client told so.

A request may say how long it may take (`request_timeout_s`), and a server may cap every
request (`llmserve serve --request-timeout-s`, the Triton chat model's `request_timeout_s`
parameter, which the gateway sets through `llmserve up`): the shorter one holds, counted from
the request's arrival. A whole answer past it is a 504 (`request_timeout`); a stream ends
with that error as its last event, then `[DONE]`. Either way the generation stops at once
(the engine's requests are aborted as the awaited work is cancelled), so a request nobody
waits for any longer cannot hold the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from llmserve.openai.errors import APIError, sse_error
from llmserve.openai.reply import Reply

CODE = "request_timeout"


def effective_timeout(asked: float | None, cap: float | None) -> float | None:
    """The seconds a request gets: the shorter of what it asked and the server's cap (None: no deadline)."""
    given = [t for t in (asked, cap) if t is not None and t > 0]
    return min(given) if given else None


def _expired(timeout_s: float) -> APIError:
    return APIError(504, f"the request did not finish within {timeout_s:g} s (request_timeout_s): it was stopped",
                    code=CODE)  # fmt: skip


def with_deadline(reply: Reply, timeout_s: float | None) -> Reply:
    """`reply` whose body or events end `timeout_s` seconds from now (no change without one)."""
    if timeout_s is None or reply.error is not None:
        return reply
    deadline = asyncio.get_running_loop().time() + timeout_s
    if reply.body is not None:
        return Reply(status=reply.status, body=_body_by(reply.body, deadline, timeout_s))
    if reply.events is not None:
        return Reply(status=reply.status, events=_events_by(reply.events, deadline, timeout_s))
    return reply


async def _body_by(body: Awaitable[dict], deadline: float, timeout_s: float) -> dict:
    try:
        async with asyncio.timeout_at(deadline):
            return await body
    except TimeoutError:
        raise _expired(timeout_s) from None


async def _events_by(events: AsyncIterator[str], deadline: float, timeout_s: float) -> AsyncIterator[str]:
    """The events until [DONE], or until the deadline: then the 504 as an error event and [DONE]."""
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                exc = _expired(timeout_s)
                yield sse_error(exc.status, exc.message, exc.code)
                yield "data: [DONE]\n\n"
                return
            yield event
    finally:
        await events.aclose()  # (cut short, or the client left: its engine requests are aborted)
