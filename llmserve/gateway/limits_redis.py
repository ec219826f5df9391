"""Token buckets in Redis, shared by every gateway process that points at the same server.

Each check-and-take is one Lua script (EVALSHA, loaded on first use), so it is atomic across
gateways; the clock is Redis's own (`TIME`), so gateways on different hosts agree on refills.
A bucket is a hash {level, stamp}; a missing one is full, and each expires once it would be
full again, so idle keys leave nothing behind.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from llmserve.gateway.config import ApiKey, LimitsConfig
from llmserve.gateway.limits import (
    TPM,
    KeyCapacities,
    LimitExceeded,
    LimitsUnavailable,
    retry_after,
)

logger = logging.getLogger(__name__)

# shared by both scripts: refill KEYS[i] (capacity `cap`) up to now
_REFILL = """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function refilled(key, cap, now)
  local state = redis.call('HMGET', key, 'level', 'stamp')
  local level = tonumber(state[1]) or cap
  local stamp = tonumber(state[2]) or now
  return math.min(cap, level + math.max(0, now - stamp) * cap / 60)
end
local function store(key, cap, level, now)
  redis.call('HSET', key, 'level', tostring(level), 'stamp', tostring(now))
  redis.call('PEXPIRE', key, math.ceil(((cap - level) * 60 / cap + 1) * 1000))
end
"""

# KEYS: buckets; ARGV: capacity, amount for each. Returns {0, "0"} when taken from all, or
# {i, wait_seconds} naming the first bucket that is short (nothing taken).
RESERVE = (
    _REFILL
    + """
local now = now_s()
local levels = {}
for i = 1, #KEYS do
  local cap, amount = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local level = refilled(KEYS[i], cap, now)
  if level < amount then
    return {i, tostring((amount - level) * 60 / cap)}
  end
  levels[i] = level - amount
end
for i = 1, #KEYS do
  store(KEYS[i], tonumber(ARGV[2 * i - 1]), levels[i], now)
end
return {0, '0'}
"""
)

# KEYS[1]: a bucket; ARGV: capacity, delta (> 0 gives back, < 0 takes; never above capacity)
SETTLE = (
    _REFILL
    + """
local now = now_s()
local cap = tonumber(ARGV[1])
store(KEYS[1], cap, math.min(cap, refilled(KEYS[1], cap, now) + tonumber(ARGV[2])), now)
return 0
"""
)


class RedisLimiter:
    def __init__(self, keys: list[ApiKey], config: LimitsConfig):
        self.capacities = KeyCapacities(keys)
        self.config = config
        self._redis = aioredis.from_url(
            config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
        )
        self._reserve = self._redis.register_script(RESERVE)
        self._settle = self._redis.register_script(SETTLE)

    def _name(self, key: str, bucket: str) -> str:
        return f"{self.config.prefix}:{key}:{bucket}"

    async def reserve(self, key: str, tokens: int) -> None:
        demands = self.capacities.demands(key, tokens)
        if not demands:
            return
        args = [v for d in demands for v in (d.capacity, d.amount)]
        try:
            short, wait = await self._reserve(keys=[self._name(key, d.reason) for d in demands], args=args)
        except (RedisError, OSError) as exc:
            self._unavailable(exc)
            return
        if int(short):
            raise LimitExceeded(demands[int(short) - 1].reason, retry_after(float(wait)))

    async def settle(self, key: str, reserved: int, used: int) -> None:
        cap = self.capacities.tpm.get(key)
        if cap is None or used == reserved:
            return
        try:
            await self._settle(keys=[self._name(key, TPM)], args=[cap, reserved - used])
        except (RedisError, OSError) as exc:
            logger.warning("could not settle %s's tokens in Redis: %s", key, exc)

    def _unavailable(self, exc: Exception) -> None:
        if not self.config.fail_open:
            raise LimitsUnavailable(str(exc)) from exc
        logger.warning("Redis limits unavailable, letting the request through: %s", exc)

    async def close(self) -> None:
        await self._redis.aclose()
