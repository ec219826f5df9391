"""What an upstream call gives back once it is committed to: a whole body, or a stream's lines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass


class UpstreamFailed(Exception):
    """The replica failed before anything was passed on: another may be tried.

    `status`/`content` hold its error reply when it sent one (a 5xx), else None. `overloaded`:
    busy, not broken (a 503). `unavailable`: it is down (unreachable, its backend dead), so
    waiting for it to come back may help. `accepted`: it had taken the request when it failed
    (the request may be what broke it): such a request is sent again once at most."""

    def __init__(self, message: str, status: int | None = None, content: bytes | None = None,
                 overloaded: bool = False, unavailable: bool = False, accepted: bool = False):  # fmt: skip
        super().__init__(message)
        self.status, self.content, self.overloaded, self.unavailable = status, content, overloaded, unavailable
        self.accepted = accepted


@dataclass
class Opened:
    status: int
    content: bytes | None  # a whole (non-streamed) body
    # a stream: what is left after `first`, line by line; a line may end with "\n" (an event
    # with the blank line that ends it, sent in one write)
    lines: AsyncIterator[str] | None
    first: str | None  # a stream's first line, read before committing to this replica
    close: Callable[[], Awaitable[None]]  # drops the upstream call (the replica aborts the request)
