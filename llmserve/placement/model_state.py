"""Each placed model's state and what happened to it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from llmserve.placement.footprint import Footprint


class ModelState(str, Enum):
    RESIDENT = "resident"  # weights and KV cache on the device: requests run
    ASLEEP = "asleep"  # device memory given back; a request wakes it
    WAKING = "waking"  # planned to wake: its victims sleep first, then its weights come back
    SLEEPING = "sleeping"  # going to sleep (it still holds its memory until done)


@dataclass
class PlacedModel:
    name: str
    footprint: Footprint
    state: ModelState = ModelState.RESIDENT
    in_flight: int = 0  # requests admitted and not finished, waiting for a wake included
    running: int = 0  # of those, the ones running on it now
    draining_for: str | None = None  # resident, making room for this model: new requests wait
    last_used: float = 0.0  # when a request last arrived or finished
    waiting_since: float | None = None  # the oldest request waiting for this model to wake
    wake_cost_s: float = 1.0  # one wake, as last measured (a guess until then)
    sleep_cost_s: float = 1.0  # one sleep, ditto
    wakes: int = 0
    sleeps: int = 0
    prewarms: int = 0  # wakes started with no request waiting
    wake_seconds: float = 0.0  # all wakes together
    sleep_seconds: float = 0.0
    failed_wakes: int = 0
    failed_wake_at: float | None = None  # when the last wake failed (the next waits a little)
    loading: bool = False  # WAKING and its weights are moving in (its victims are asleep)
    prewarming: bool = False  # WAKING with no request waiting for it

    @property
    def holds_memory(self) -> bool:
        """Whether its memory counts against the budget now (a wake counts from its plan)."""
        return self.state is not ModelState.ASLEEP

    @property
    def idle(self) -> bool:
        """Nothing runs on it, and no request waits to (a draining model's waiters wait for
        it to sleep and wake again)."""
        return self.running == 0 and (self.in_flight == 0 or self.draining_for is not None)

    @property
    def runnable(self) -> bool:
        return self.state is ModelState.RESIDENT and self.draining_for is None
