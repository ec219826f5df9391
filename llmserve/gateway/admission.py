"""Admission: a global concurrency cap with a priority-ordered wait, and load shedding by queueing delay.

A request takes a slot before it is sent upstream and gives it back when its response is over
(the last byte of a stream). With every slot taken, it waits in a queue ordered by priority
(then arrival) for at most `queue_timeout_s`, then gets 503 `queue_timeout`.

Shedding: the measured queueing delay is the larger of how long the oldest request now waiting
for a slot has waited and how long requests for the alias waited in the upstream engines' own
queues over the last few seconds (their `vllm:request_queue_time_seconds`, scraped each second
by the status sampler, handed to `Admission` as its `engines`). Priority classes are the
distinct key priorities, lowest first. While the delay is above `(i + 1) x target`, class i
is shed: refused at once with 503 `queue_delay`, and its requests already waiting are refused
once their own wait crosses that line. So the lowest class goes first; the highest class (when
there are several) is never shed for delay, only bounded by the queue timeout.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from llmserve.gateway.config import AdmissionConfig


class EngineQueues(Protocol):
    """What admission reads of the upstream engines (the status sampler)."""

    def engine_delay(self, alias: str) -> float:
        """Seconds requests for `alias` now wait in the upstream engines' queues."""


class Refused(Exception):
    """No slot: shed for queueing delay, or waited past the queue timeout."""

    def __init__(self, reason: str, retry_after: float):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


@dataclass(order=True)
class _Waiter:
    rank: tuple[int, int]  # (-priority, arrival number): the heap's first is served next
    since: float = field(compare=False)
    granted: asyncio.Future = field(compare=False)


class Slot:
    """A held slot; `release()` may be called more than once."""

    def __init__(self, admission: Admission | None):
        self._admission = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission._release()
            self._admission = None


class Admission:
    def __init__(self, config: AdmissionConfig, priorities: list[int], engines: EngineQueues | None = None):
        self.config = config
        self.engines = engines  # None: shed by the gateway's own queue only
        self.classes = sorted(set(priorities)) or [0]
        self.in_flight = 0
        self._queue: list[_Waiter] = []
        self._arrivals = itertools.count()

    def queueing_delay(self) -> float:
        """Seconds the oldest request still waiting for a slot has waited (0 when none waits)."""
        waiting = [w.since for w in self._queue if not w.granted.done()]
        return time.monotonic() - min(waiting) if waiting else 0.0

    def shed_after(self, priority: int) -> float:
        """The queueing delay above which this priority is shed (inf: never)."""
        if self.config.target_queue_delay_ms is None:
            return math.inf
        index = self.classes.index(priority) if priority in self.classes else 0
        if len(self.classes) > 1 and index == len(self.classes) - 1:
            return math.inf
        return (index + 1) * self.config.target_queue_delay_ms / 1000.0

    def waiting(self) -> int:
        return sum(1 for w in self._queue if not w.granted.done())

    def would_wait(self) -> bool:
        """Whether a request arriving now would queue for a slot (or be refused)."""
        cap = self.config.max_concurrency
        return cap is not None and (self.in_flight >= cap or self.waiting() > 0)

    def engine_delay(self, alias: str | None) -> float:
        """Seconds requests for `alias` now wait in the engines' queues (0 when not shedding)."""
        if alias is None or self.engines is None or self.config.target_queue_delay_ms is None:
            return 0.0
        return self.engines.engine_delay(alias)

    async def acquire(self, priority: int, alias: str | None = None) -> Slot:
        """A slot for a request of this priority for `alias` (whose engines' queues count too)."""
        limit = self.shed_after(priority)
        if (delay := max(self.queueing_delay(), self.engine_delay(alias))) > limit:
            raise Refused("queue_delay", max(1.0, math.ceil(delay)))
        if not self.would_wait():
            self.in_flight += 1
            return Slot(self)
        if self.waiting() >= self.config.max_queue:
            raise Refused("queue_full", 1.0)
        waiter = _Waiter(
            (-priority, next(self._arrivals)), time.monotonic(), asyncio.get_running_loop().create_future()
        )
        heapq.heappush(self._queue, waiter)
        timeout = min(self.config.queue_timeout_s, limit)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), timeout)
        except TimeoutError:
            if waiter.granted.done():  # granted in the same instant: keep it
                return Slot(self)
            waiter.granted.cancel()
            reason = "queue_delay" if limit < self.config.queue_timeout_s else "queue_timeout"
            raise Refused(reason, max(1.0, math.ceil(timeout))) from None
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release()  # the slot came as we were cancelled: pass it on
            waiter.granted.cancel()
            raise
        return Slot(self)

    def _release(self) -> None:
        self.in_flight -= 1
        while self._queue:
            waiter = heapq.heappop(self._queue)
            if not waiter.granted.done():  # skip the ones that gave up
                self.in_flight += 1
                waiter.granted.set_result(None)
                return
