"""Replicas, their health, and which one takes the next request (least outstanding, prefix
affinity, or by the replicas' cached prefix of the prompt: kv_routing.py)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

from llmserve.gateway.adapters import AdapterHoldings
from llmserve.gateway.affinity import rendezvous_score
from llmserve.gateway.config import GatewayConfig, HealthConfig, ModelRoute
from llmserve.gateway.kv_prompt import KVPrompt
from llmserve.gateway.kv_routing import KVRouting

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    alias: str
    url: str
    failures: int = 0  # consecutive failed health checks or requests
    healthy: bool = True  # False while the circuit breaker is open
    _outstanding: int = field(default=0, repr=False)  # changed only by `_count`

    @property
    def outstanding(self) -> int:
        """Requests sent and not yet finished."""
        return self._outstanding

    def send(self) -> InFlight:
        """A request goes to this replica: counted until its `InFlight.end()`."""
        self._count(1)
        return InFlight(self)

    def _count(self, delta: int) -> None:
        self._outstanding += delta

    def record_failure(self, threshold: int) -> None:
        self.failures += 1
        if self.healthy and self.failures >= threshold:
            logger.warning("replica %s of %s: breaker open after %d failures", self.url, self.alias, self.failures)
            self.healthy = False

    def record_success(self) -> None:
        if not self.healthy:
            logger.info("replica %s of %s: healthy again", self.url, self.alias)
        self.failures, self.healthy = 0, True


class InFlight:
    """One request sent to a replica; `end()` (when its answer is over or failed) may be called
    more than once, and counts it out only the first time."""

    def __init__(self, replica: Replica):
        self._replica: Replica | None = replica

    def end(self) -> None:
        if self._replica is not None:
            self._replica._count(-1)
            self._replica = None


@dataclass
class Pick:
    alias: str  # the alias that serves (the fallback's when it was used)
    route: ModelRoute
    replica: Replica
    # or "affinity", "affinity_overloaded" (left its home replica); kv_aware: "kv_prefix" (it holds
    # some of the prompt), "kv_load" (none does), "kv_fallback" (no live stream or no prompt to go by)
    decision: str = "least_outstanding"


class Router:
    def __init__(self, config: GatewayConfig, adapters: AdapterHoldings | None = None, kv: KVRouting | None = None):
        self.config = config
        self.adapters = adapters  # which replica holds which LoRA adapter (routes with `lora`)
        self.kv = kv  # the replicas' KV caches by their events (routes with routing kv_aware)
        self.replicas = {a: [Replica(a, u) for u in r.replicas] for a, r in config.models.items()}
        self._turn = itertools.count()  # breaks ties so idle replicas take turns
        self.uses_affinity = any(r.routing == "prefix_affinity" for r in config.models.values())

    def _available(self, alias: str, exclude: set[str]) -> list[Replica]:
        cap = self.config.models[alias].max_concurrency
        return [
            r for r in self.replicas[alias]
            if r.healthy and r.url not in exclude and (cap is None or r.outstanding < cap)
        ]  # fmt: skip

    def pick(self, alias: str, exclude: set[str] = frozenset(), prefix: str | None = None,
             kv_prompt: KVPrompt | None = None) -> Pick | None:  # fmt: skip
        """A replica of the alias (its fallback's when none can take the request).

        `least_outstanding`: the fewest requests in flight, ties taking turns.
        `prefix_affinity`: the replica `prefix` hashes to among those available, unless it has
        more than `affinity_max_imbalance` requests over the least loaded one.
        `kv_aware`: the replica holding the longest cached prefix of `kv_prompt` against its load,
        among those within `affinity_max_imbalance` of the least loaded (kv_routing.py).
        """
        seen = set()
        while alias is not None and alias not in seen:
            seen.add(alias)
            route = self.config.models[alias]
            candidates = self._available(alias, exclude)
            if candidates:
                least = min(r.outstanding for r in candidates)
                held = self._holding(route, candidates)
                if held:  # a replica with the adapter loaded, unless it is busier than the rest by too much
                    fewest = min(r.outstanding for r in held)
                    if fewest <= least + route.affinity_max_imbalance:
                        tied = [r for r in held if r.outstanding == fewest]
                        return Pick(alias, route, tied[next(self._turn) % len(tied)], "adapter_held")
                if route.routing == "prefix_affinity" and prefix is not None:
                    home = max(candidates, key=lambda r: rendezvous_score(prefix, r.url))
                    if home.outstanding <= least + route.affinity_max_imbalance:
                        return Pick(alias, route, home, "affinity")
                    decision = "affinity_overloaded"
                elif route.routing == "kv_aware" and self.kv is not None:
                    turn = next(self._turn)  # (one a pick, as below: ties must keep taking turns)
                    choice = self.kv.choose(alias, candidates, kv_prompt, route.affinity_max_imbalance, turn)
                    if choice is not None:
                        return Pick(alias, route, choice.replica, choice.decision)
                    tied = [r for r in candidates if r.outstanding == least]
                    return Pick(alias, route, tied[turn % len(tied)], "kv_fallback")
                else:
                    decision = "least_outstanding"
                tied = [r for r in candidates if r.outstanding == least]
                return Pick(alias, route, tied[next(self._turn) % len(tied)], decision)
            alias = route.fallback
        return None

    def all_down(self, alias: str) -> bool:
        """Every replica of `alias` and of its fallbacks has its breaker open (none is merely busy)."""
        seen = set()
        while alias is not None and alias not in seen:
            seen.add(alias)
            if any(r.healthy for r in self.replicas[alias]):
                return False
            alias = self.config.models[alias].fallback
        return True

    def _holding(self, route: ModelRoute, candidates: list[Replica]) -> list[Replica]:
        if route.lora is None or self.adapters is None:
            return []
        return [r for r in candidates if self.adapters.holds(r.url, route.lora)]

    def all_replicas(self) -> list[Replica]:
        return [r for rs in self.replicas.values() for r in rs]


async def health_loop(router: Router, health: HealthConfig, probe, on_change) -> None:
    """Poll every replica (`probe(replica) -> bool`); the breaker opens after `failure_threshold`
    failures in a row."""

    async def check(r: Replica) -> None:
        r.record_success() if await probe(r) else r.record_failure(health.failure_threshold)
        on_change(r)

    while True:
        await asyncio.gather(*(check(r) for r in router.all_replicas()))
        await asyncio.sleep(health.interval_s)
