"""The live side of placement: requests wait for their model to wake, plans run on an actuator.

`acquire(name)` holds a request until its model is resident (waking it, and putting idle
models to sleep first, as the placement decides), for at most `wake_timeout_s`; `release`
ends it. A background loop asks for pre-warms. Everything runs on one event loop, so the
decisions between two awaits are atomic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from llmserve.placement.placement import Placement, WakePlan

logger = logging.getLogger("llmserve.placement")


class Actuator(Protocol):
    """Puts one model's engine to sleep and wakes it."""

    async def sleep(self, name: str, level: int) -> bool:
        """False if the engine could not sleep now (it had work)."""

    async def wake(self, name: str) -> None: ...


class WakeTimeout(Exception):
    """The model did not become resident within the wait."""

    def __init__(self, name: str, waited_s: float, retry_after_s: float) -> None:
        super().__init__(f"the model {name!r} was not awake after {waited_s:.0f} s")
        self.name, self.retry_after_s = name, retry_after_s


class PlacementController:
    def __init__(self, placement: Placement, actuator: Actuator, *, sleep_level: int = 1,
                 wake_timeout_s: float = 60.0, prewarm_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[str, str, float], None] | None = None) -> None:  # fmt: skip
        if sleep_level not in (1, 2):
            raise ValueError("sleep_level must be 1 or 2")
        self.placement = placement
        self.actuator = actuator
        self.sleep_level = sleep_level
        self.wake_timeout_s = wake_timeout_s
        self.prewarm_interval_s = prewarm_interval_s
        self.clock = clock
        self.on_event = on_event or (lambda model, event, seconds: None)  # "wake" | "prewarm" | "sleep" | "wake_failed"
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def manages(self, name: str) -> bool:
        return name in self.placement.models

    # -- requests --------------------------------------------------------------------------
    async def acquire(self, name: str) -> None:
        """Return once `name` is resident, counted as running on it (so never put to sleep)
        until `release(name)`; WakeTimeout after `wake_timeout_s` (the request is not counted)."""
        start = self.clock()
        if self.placement.arrive(name, start):
            return
        try:
            async with asyncio.timeout(self.wake_timeout_s):
                while not self.placement.start(name):
                    changed = self._changed  # taken before planning: a plan may signal (a drain ended)
                    self._plan()
                    await changed.wait()
        except BaseException as exc:
            self.placement.depart(name, self.clock(), ran=False)
            self._signal()
            if isinstance(exc, TimeoutError):
                retry = max(1.0, self.placement.models[name].wake_cost_s)
                raise WakeTimeout(name, self.clock() - start, retry) from None
            raise

    def release(self, name: str) -> None:
        self.placement.depart(name, self.clock())
        self._signal()  # an idle model may now make room for a waiting one

    # -- plans -----------------------------------------------------------------------------
    def _plan(self) -> None:
        now = self.clock()
        if self.placement.clear_stale_drains():
            self._signal()  # a drained model's own waiting requests may run again
        for model in self.placement.waiting():
            plan = self.placement.plan_wake(model.name, now)
            if plan is not None:
                self._spawn(self._run(plan))

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, plan: WakePlan) -> None:
        try:
            await asyncio.gather(*(self._sleep(v) for v in plan.victims))
            if not self.placement.victims_done(plan):
                return
            start = self.clock()
            try:
                await self.actuator.wake(plan.model)
                ok = True
            except Exception:  # noqa: BLE001 - a failed wake leaves the model asleep; its requests time out
                logger.exception("waking %s failed", plan.model)
                ok = False
            seconds = self.clock() - start
            self.placement.wake_done(plan.model, ok, seconds, self.clock())
            self.on_event(plan.model, ("prewarm" if plan.prewarm else "wake") if ok else "wake_failed", seconds)
            logger.info("%s %s in %.2f s%s", plan.model, "woke" if ok else "did not wake", seconds,
                        " (pre-warm)" if plan.prewarm else "")  # fmt: skip
        finally:
            self._signal()

    async def _sleep(self, name: str) -> None:
        start = self.clock()
        try:
            ok = await self.actuator.sleep(name, self.sleep_level)
        except Exception:  # noqa: BLE001 - an engine that cannot sleep stays resident
            logger.exception("putting %s to sleep failed", name)
            ok = False
        seconds = self.clock() - start
        self.placement.sleep_done(name, ok, seconds, self.clock())
        if ok:
            self.on_event(name, "sleep", seconds)
            logger.info("%s asleep after %.2f s", name, seconds)

    async def fit(self) -> None:
        """Put idle models to sleep until the resident ones fit the budget (at start)."""
        names = self.placement.plan_fit(self.clock())
        await asyncio.gather(*(self._sleep(n) for n in names))
        self._signal()

    # -- waiting ---------------------------------------------------------------------------
    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def run(self) -> None:
        """The pre-warm loop (and a retry of waiting plans), for the life of the server."""
        while True:
            await asyncio.sleep(self.prewarm_interval_s)
            self._plan()
            plan = self.placement.plan_prewarm(self.clock())
            if plan is not None:
                self._spawn(self._run(plan))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    def snapshot(self) -> dict:
        p = self.placement
        return {"budget_bytes": p.budget_bytes, "committed_bytes": p.committed_bytes, "fixed_bytes": p.fixed_bytes,
                "device_bytes": p.device_bytes,
                "policy": p.policy.name, "models": p.snapshot(self.clock())}  # fmt: skip
