"""Per-model arrival rates: exponentially decayed counts of requests."""

from __future__ import annotations

import math


class ArrivalRate:
    """rate = (decayed count of arrivals) / tau, with tau = half_life / ln 2: a steady stream
    of r requests a second reads r, and a model nobody calls decays to 0."""

    def __init__(self, half_life_s: float = 60.0) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self.tau = half_life_s / math.log(2)
        self._count: dict[str, tuple[float, float]] = {}  # name -> (decayed count, at)

    def record(self, name: str, now: float) -> None:
        self._count[name] = (self._decayed(name, now) + 1.0, now)

    def rate(self, name: str, now: float) -> float:
        return self._decayed(name, now) / self.tau

    def _decayed(self, name: str, now: float) -> float:
        count, at = self._count.get(name, (0.0, now))
        return count * math.exp(-max(0.0, now - at) / self.tau)
