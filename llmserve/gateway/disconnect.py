"""A client that goes away while the gateway waits for it (a slot, a wake, the upstream)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientLeft(Exception):
    """The client went away before its answer was ready (waiting for a slot, or upstream)."""


async def unless_client_leaves(work: Awaitable[T], request: Request) -> T:
    """Await `work`, cancelled (ClientLeft) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        raise ClientLeft() from None


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
