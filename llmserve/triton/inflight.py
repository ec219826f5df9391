"""The Triton chat model's requests in flight, watched for clients that left.

Triton tells a model that a request's client went away (`request.is_cancelled()`): over gRPC
when the client cancels its call, over HTTP only once Triton writes to the closed connection
— its HTTP server reads nothing while a request runs (triton-inference-server/server#7077).
A request that writes nothing for a while (a whole answer being made, a stream still queued
in the engine) was never told, and ran to its end for nobody. So one watcher, for every
request in flight:
- asks Triton about each request that has not been asked for `poll_s`, and cancels the
  request's task when its client left (the task's cleanup aborts it in the engine);
- writes a keep-alive to each request that asked for them (`keepalive_s` > 0) and has sent
  nothing for that long, so that Triton's HTTP server finds a closed connection.

A stream that sends tokens asks for itself as it sends (`due`), so an active stream costs the
watcher nothing. The watcher knows nothing of Triton: a request is anything with
`is_cancelled()`, a keep-alive a callable (tests give plain objects).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a quiet request is asked about (a round trip to Triton)


@dataclass(eq=False)
class InFlight:
    """One request: its Triton request, the task that serves it, and its keep-alives."""

    request: Any  # has is_cancelled()
    task: asyncio.Task
    keepalive_s: float  # 0: no keep-alives
    send_keepalive: Callable[[], None]
    last_sent: float = field(default_factory=time.monotonic)  # a response or keep-alive written
    last_asked: float = field(default_factory=time.monotonic)  # is_cancelled() asked
    cancelled: bool = False

    def sent(self, now: float) -> None:
        self.last_sent = now


class InFlightWatch:
    """Every request in flight on one event loop; `run()` is the watcher (a task on that loop)."""

    def __init__(self, poll_s: float = POLL_S) -> None:
        self.poll_s = poll_s
        self.requests: set[InFlight] = set()
        self.keepalives = 0  # written, in all (for tests and logs)

    def add(self, request: Any, task: asyncio.Task, keepalive_s: float,
            send_keepalive: Callable[[], None]) -> InFlight:  # fmt: skip
        entry = InFlight(request, task, max(0.0, keepalive_s), send_keepalive)
        self.requests.add(entry)
        return entry

    def remove(self, entry: InFlight) -> None:
        self.requests.discard(entry)

    def due(self, entry: InFlight, now: float) -> bool:
        """True when `entry`'s client left (`entry.cancelled`); asks Triton at most once every
        `poll_s` for it. A stream asks as it sends, and ends itself."""
        if entry.cancelled:
            return True
        if now - entry.last_asked < self.poll_s:
            return False
        entry.last_asked = now
        entry.cancelled = bool(entry.request.is_cancelled())
        return entry.cancelled

    def tick(self, now: float | None = None) -> None:
        """One pass: ask about the quiet requests, keep the quiet connections written to."""
        now = time.monotonic() if now is None else now
        for entry in list(self.requests):
            if entry.cancelled:  # a stream found it so itself, and ends itself
                continue
            if self.due(entry, now):
                self.requests.discard(entry)
                entry.task.cancel()  # its cleanup aborts the request in the engine
            elif entry.keepalive_s and now - entry.last_sent >= entry.keepalive_s:
                entry.last_sent = now
                try:
                    entry.send_keepalive()
                    self.keepalives += 1
                except Exception as exc:  # noqa: BLE001 - a closed stream: its next ask tells
                    logger.debug("a keep-alive could not be sent (%s: %s)", type(exc).__name__, exc)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                self.tick()
            except Exception:  # a watcher that died would let every departed client run on
                logger.exception("the in-flight watcher failed a pass")
