"""Per-key limits: token buckets for requests and tokens per minute.

Two stores share one interface (`Limiter`): buckets in this process's memory (the default),
or in Redis (`limits_redis.RedisLimiter`) when several gateways must share one set of limits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from llmserve.gateway.config import ApiKey, LimitsConfig

RPM, TPM = "requests_per_minute", "tokens_per_minute"


class LimitExceeded(Exception):
    def __init__(self, reason: str, retry_after: float | None):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class OverCapacity(LimitExceeded):
    """One request asks more than the bucket holds: it can never be admitted (no retry helps)."""

    def __init__(self, reason: str, asked: int, capacity: int):
        super().__init__(reason, None)
        self.asked, self.capacity = asked, capacity


class LimitsUnavailable(Exception):
    """The shared limit store cannot be reached (and the config says to refuse then)."""


class Limiter(Protocol):
    async def reserve(self, key: str, tokens: int) -> None:
        """Take one request and `tokens` up front, or raise LimitExceeded taking nothing."""

    async def settle(self, key: str, reserved: int, used: int) -> None:
        """The real usage is known: return what was reserved and not used (or take the excess)."""

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Demand:
    """What one request takes from one bucket."""

    reason: str  # RPM or TPM: also the bucket's name
    capacity: int
    amount: int


class KeyCapacities:
    """Each key's configured rpm/tpm, and what a request asks of them."""

    def __init__(self, keys: list[ApiKey]):
        self.rpm = {k.name: k.rpm for k in keys if k.rpm}
        self.tpm = {k.name: k.tpm for k in keys if k.tpm}

    def demands(self, key: str, tokens: int) -> list[Demand]:
        out = []
        if key in self.rpm:
            out.append(Demand(RPM, self.rpm[key], 1))
        if key in self.tpm:
            if tokens > self.tpm[key]:
                raise OverCapacity(TPM, tokens, self.tpm[key])  # more than the bucket holds: never admissible
            out.append(Demand(TPM, self.tpm[key], tokens))
        return out


def retry_after(wait_s: float) -> float:
    return max(1.0, math.ceil(wait_s))


@dataclass
class TokenBucket:
    """Holds up to `capacity`, refilled at capacity per minute."""

    capacity: float
    level: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.capacity

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 when it is now)."""
        self._refill()
        if self.level >= amount:
            return 0.0
        return (amount - self.level) * 60.0 / self.capacity

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)


class RateLimiter:
    """Buckets in this process's memory: per key a request bucket and a token bucket."""

    def __init__(self, keys: list[ApiKey]):
        self.capacities = KeyCapacities(keys)
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def bucket(self, key: str, demand: Demand) -> TokenBucket:
        found = self._buckets.get((key, demand.reason))
        if found is None:
            found = self._buckets[(key, demand.reason)] = TokenBucket(demand.capacity)
        return found

    async def reserve(self, key: str, tokens: int) -> None:
        demands = self.capacities.demands(key, tokens)
        for d in demands:  # check all, then take from all: both or neither
            if (wait := self.bucket(key, d).wait_for(d.amount)) > 0:
                raise LimitExceeded(d.reason, retry_after(wait))
        for d in demands:
            self.bucket(key, d).take(d.amount)

    async def settle(self, key: str, reserved: int, used: int) -> None:
        if key in self.capacities.tpm:
            tok = self.bucket(key, Demand(TPM, self.capacities.tpm[key], 0))
            tok.give_back(reserved - used) if used <= reserved else tok.take(used - reserved)

    async def close(self) -> None:
        return None


def build_limiter(keys: list[ApiKey], config: LimitsConfig) -> Limiter:
    if config.backend == "redis":
        from llmserve.gateway.limits_redis import RedisLimiter

        return RedisLimiter(keys, config)
    return RateLimiter(keys)
