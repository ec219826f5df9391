"""Dynamic batching inside one server process.

Requests that arrive while a batch runs (or within `max_wait_s` of the first waiting one)
are run together as one call of `fn` over all their items, in a worker thread, one batch
at a time; each request gets its own slice of the results back. A request larger than
`max_items` goes in slices of `max_items`, one after the other, so requests arriving
meanwhile run between its slices instead of waiting for all of it; its `gone()` check is
asked between slices, and a request whose client left stops there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending(Generic[T]):
    items: Sequence[T]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class MicroBatcher(Generic[T, R]):
    def __init__(self, fn: Callable[[list[T]], Sequence[R]], max_items: int = 64, max_wait_s: float = 0.002,
                 on_batch: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
        """`fn` maps a list of items to one result per item; `on_batch(requests, items)`
        is told the size of every batch run."""
        self.fn = fn
        self.max_items = max_items
        self.max_wait_s = max_wait_s
        self.on_batch = on_batch
        self._queue: list[_Pending[T]] = []
        self._running: list[_Pending[T]] = []  # the batch in the worker thread now
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    async def submit(self, items: Sequence[T], gone: Callable[[], Awaitable[bool]] | None = None) -> list[R]:
        """One result per item. `gone()` (the client left?) is asked between the slices of a
        request larger than a batch: CancelledError then, and the rest is not run."""
        results: list[R] = []
        for start in range(0, len(items), self.max_items):
            if start and gone is not None and await gone():
                raise asyncio.CancelledError("the client left")
            results += await self._submit_one(items[start : start + self.max_items])
        return results

    async def _submit_one(self, items: Sequence[T]) -> list[R]:
        if not items:
            return []
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.create_task(self._run())
        pending = _Pending(items)
        self._queue.append(pending)
        self._wakeup.set()
        return await pending.future

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for p in self._queue + self._running:
            if not p.future.done():
                p.future.set_exception(RuntimeError("the server is shutting down"))
        self._queue.clear()
        self._running = []

    def _take(self) -> list[_Pending[T]]:
        """The oldest requests whose items fit in one batch (at least one request)."""
        batch, count = [], 0
        while self._queue and (not batch or count + len(self._queue[0].items) <= self.max_items):
            p = self._queue.pop(0)
            if p.future.cancelled():  # its client left while it waited
                continue
            batch.append(p)
            count += len(p.items)
        return batch

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if sum(len(p.items) for p in self._queue) < self.max_items:
                await asyncio.sleep(self.max_wait_s)  # let a burst gather
            while self._queue:
                batch = self._take()
                if not batch:
                    continue
                items = [x for p in batch for x in p.items]
                if self.on_batch is not None:
                    self.on_batch(len(batch), len(items))
                self._running = batch
                try:
                    results = await asyncio.to_thread(self.fn, items)
                except Exception as exc:  # noqa: BLE001 - every request of the batch gets it
                    self._running = []
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                self._running = []
                start = 0
                for p in batch:
                    if not p.future.done():
                        p.future.set_result(list(results[start : start + len(p.items)]))
                    start += len(p.items)
