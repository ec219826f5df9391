"""Per-key limits: token buckets for requests and tokens per minute, held in memory."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from llmserve.gateway.config import ApiKey


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
        self.level = min(self.capacity, self.level + amount)


class LimitExceeded(Exception):
    def __init__(self, reason: str, retry_after: float):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class RateLimiter:
    """Per key: a request bucket and a token bucket. Check both, then take from both."""

    def __init__(self, keys: list[ApiKey]):
        self._requests = {k.name: TokenBucket(k.rpm) for k in keys if k.rpm}
        self._tokens = {k.name: TokenBucket(k.tpm) for k in keys if k.tpm}

    def reserve(self, key: str, tokens: int) -> None:
        """Take one request and `tokens` up front, or raise LimitExceeded taking nothing."""
        req, tok = self._requests.get(key), self._tokens.get(key)
        if tok is not None and tokens > tok.capacity:
            raise LimitExceeded("tokens_per_minute", 60.0)
        for reason, bucket, amount in (("requests_per_minute", req, 1), ("tokens_per_minute", tok, tokens)):
            if bucket is not None and (wait := bucket.wait_for(amount)) > 0:
                raise LimitExceeded(reason, max(1.0, math.ceil(wait)))
        if req is not None:
            req.take(1)
        if tok is not None:
            tok.take(tokens)

    def settle(self, key: str, reserved: int, used: int) -> None:
        """The real usage is known: return what was reserved and not used (or take the excess)."""
        tok = self._tokens.get(key)
        if tok is not None:
            tok.give_back(reserved - used) if used <= reserved else tok.take(used - reserved)
