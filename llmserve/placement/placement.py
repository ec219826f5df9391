"""The placement decisions: which models hold device memory, within one budget.

Synchronous and clock-free (every call says `now`), so the live controller and the simulator
run the same decisions. Memory is counted as committed: a resident model, one going to sleep
(until it is asleep), and a waking one from the moment its wake is planned. The idle models
a wake displaces sleep first and only then do its weights move in, so the device never holds
more than the budget; while they sleep, the committed memory may exceed the budget by theirs,
and no other wake is planned into it. A model with requests in flight is never put to sleep:
when a request has waited `drain_after_s` and no idle model can make room, busy models are
drained instead (their new requests wait; once their running ones finish they sleep).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.placement.demand import ArrivalRate
from llmserve.placement.model_state import ModelState, PlacedModel
from llmserve.placement.policies import LRU, Policy, cover

RESIDENT, ASLEEP, WAKING, SLEEPING = ModelState.RESIDENT, ModelState.ASLEEP, ModelState.WAKING, ModelState.SLEEPING
WAKE_RETRY_S = 1.0  # after a failed wake, the next try waits this long


@dataclass(frozen=True)
class WakePlan:
    """Put `victims` to sleep, then wake `model`."""

    model: str
    victims: tuple[str, ...]
    prewarm: bool  # no request was waiting for it


class Placement:
    def __init__(self, models: Sequence[PlacedModel], budget_bytes: int, policy: Policy | None = None,
                 demand: ArrivalRate | None = None, max_prewarms: int = 1,
                 drain_after_s: float | None = None) -> None:  # fmt: skip
        self.models = {m.name: m for m in models}
        if len(self.models) != len(models):
            raise ValueError("placed model names must be unique")
        self.fixed_bytes = sum(m.footprint.overhead_bytes for m in models)  # held asleep too
        too_big = [m.name for m in models if m.footprint.total + self.fixed_bytes > budget_bytes]
        if too_big:
            raise ValueError(f"models larger than the whole gpu_memory_budget ({budget_bytes} bytes, "
                             f"{self.fixed_bytes} of them held by the engines asleep too) could never be served: "
                             f"{too_big}")  # fmt: skip
        self.budget_bytes = budget_bytes
        self.policy = policy or LRU()
        self.demand = demand or ArrivalRate()
        self.max_prewarms = max_prewarms  # pre-warms running at once
        self.drain_after_s = drain_after_s  # a wake waiting this long drains busy models; None: never

    # -- memory ----------------------------------------------------------------------------
    @property
    def committed_bytes(self) -> int:
        return sum(m.footprint.total for m in self.models.values() if m.state is not ASLEEP)

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.fixed_bytes - self.committed_bytes

    @property
    def device_bytes(self) -> int:
        """What the models hold on the device now: the resident, those going to sleep, and the
        waking whose weights are moving in."""
        return self.fixed_bytes + sum(m.footprint.total for m in self.models.values()
                                      if m.state in (RESIDENT, SLEEPING) or (m.state is WAKING and m.loading))  # fmt: skip

    # -- requests --------------------------------------------------------------------------
    def arrive(self, name: str, now: float) -> bool:
        """A request for `name` is admitted; True if it runs now (counted running), False if
        it waits (then `start` once `runnable`, or `depart(ran=False)`)."""
        m = self.models[name]
        self.demand.record(name, now)
        self.policy.on_arrival(m, now, self.demand)
        m.in_flight += 1
        m.last_used = now
        if m.runnable:
            m.running += 1
            return True
        if m.waiting_since is None:
            m.waiting_since = now
        return False

    def start(self, name: str) -> bool:
        """A waiting request runs if its model is runnable now (counted running)."""
        m = self.models[name]
        if not m.runnable:
            return False
        m.running += 1
        if m.running >= m.in_flight:
            m.waiting_since = None
        return True

    def depart(self, name: str, now: float, ran: bool = True) -> None:
        """A request for `name` finished (`ran`), or gave up waiting."""
        m = self.models[name]
        m.in_flight = max(0, m.in_flight - 1)
        if ran:
            m.running = max(0, m.running - 1)
        m.last_used = now
        if m.in_flight <= m.running:
            m.waiting_since = None

    def waiting(self) -> list[PlacedModel]:
        """Sleeping models with requests waiting, the longest waiting first."""
        return sorted((m for m in self.models.values() if m.state is ASLEEP and m.in_flight),
                      key=lambda m: m.waiting_since or 0.0)  # fmt: skip

    def clear_stale_drains(self) -> bool:
        """Drains whose model no longer waits (it woke, or its requests left) end; True if any
        did (their own waiting requests may run again)."""
        cleared = False
        for m in self.models.values():
            target = self.models.get(m.draining_for) if m.draining_for else None
            if target is not None and not (target.state is ASLEEP and target.in_flight):
                m.draining_for = None
                cleared = True
        return cleared

    # -- plans -----------------------------------------------------------------------------
    def _idle(self, but: PlacedModel | None = None) -> list[PlacedModel]:
        return [m for m in self.models.values() if m.state is RESIDENT and m.idle and m is not but]

    def plan_wake(self, name: str, now: float) -> WakePlan | None:
        """Wake `name` for its waiting requests, putting idle models to sleep as the policy
        orders them (those drained for it first); None while that cannot be done (every other
        resident model is busy: after `drain_after_s` busy ones are drained)."""
        m = self.models[name]
        if m.state is not ASLEEP or self._backing_off(m, now):
            return None
        need = m.footprint.total - self.free_bytes
        drained = [v for v in self.models.values() if v.draining_for == name and v.state is RESIDENT]
        idle = [v for v in self.policy.eviction_order(self._idle(m), now, self.demand) if v.draining_for != name]
        victims = [] if need <= 0 else cover(need, [v for v in drained if v.idle] + idle)
        if victims is None:
            self._drain_for(m, need, now)
            return None
        # a drain already decided that this wake is worth its victims: do not ask again
        if not drained and not self.policy.worth_waking(m, victims, now, self.demand):
            return None
        return self._commit(m, victims, prewarm=False)

    def _backing_off(self, m: PlacedModel, now: float) -> bool:
        """A wake that failed is not tried again for WAKE_RETRY_S (not in a tight loop)."""
        return m.failed_wake_at is not None and now - m.failed_wake_at < WAKE_RETRY_S

    def _drain_for(self, m: PlacedModel, need: int, now: float) -> None:
        """No idle models make room for `m`: after `drain_after_s` of waiting, drain models
        (those already drained for it, then the idle, then the busy, each in the policy's
        order) until what they hold covers it. Drained models take no new request; the busy
        ones sleep once their running requests finish. Drained again while it does not cover
        (an idle model took a request in between)."""
        if self.drain_after_s is None or m.waiting_since is None or now - m.waiting_since < self.drain_after_s:
            return
        drained = [v for v in self.models.values() if v.draining_for == m.name and v.state is RESIDENT]
        idle = [v for v in self._idle(m) if v.draining_for != m.name]
        # running ones only: a model just woken whose waiters have not started is not busy
        busy = [v for v in self.models.values() if v.runnable and v.running > 0 and v is not m]
        candidates = drained + self.policy.eviction_order(idle, now, self.demand) + \
            self.policy.eviction_order(busy, now, self.demand)  # fmt: skip
        victims = cover(need, candidates)
        if victims is None or (not drained and not self.policy.worth_waking(m, victims, now, self.demand)):
            return
        for v in victims:
            v.draining_for = m.name

    def plan_prewarm(self, now: float) -> WakePlan | None:
        """A wake ahead of requests, if the policy wants one (one at a time)."""
        if sum(m.state is WAKING and m.prewarming for m in self.models.values()) >= self.max_prewarms:
            return None
        asleep = [
            m for m in self.models.values() if m.state is ASLEEP and not m.in_flight and not self._backing_off(m, now)
        ]
        idle = self._idle()
        choice = self.policy.prewarm(asleep, idle, self.free_bytes, now, self.demand) if asleep else None
        if choice is None:
            return None
        model, victims = choice
        if model not in asleep or any(v not in idle for v in victims) or \
                model.footprint.total > self.free_bytes + sum(v.footprint.total for v in victims):  # fmt: skip
            raise RuntimeError(f"policy {self.policy.name} chose an impossible pre-warm of {model.name}")
        return self._commit(model, victims, prewarm=True)

    def plan_fit(self, now: float) -> list[str]:
        """Idle models to put to sleep until the committed memory is within the budget (a
        start with more resident than fits); they are marked going to sleep."""
        over = self.committed_bytes + self.fixed_bytes - self.budget_bytes
        if over <= 0:
            return []
        victims = cover(over, self.policy.eviction_order(self._idle(), now, self.demand)) or []
        for v in victims:
            v.state = SLEEPING
        return [v.name for v in victims]

    def _commit(self, m: PlacedModel, victims: list[PlacedModel], prewarm: bool) -> WakePlan:
        for v in victims:
            v.state = SLEEPING
        m.state, m.loading, m.prewarming = WAKING, not victims, prewarm
        return WakePlan(m.name, tuple(v.name for v in victims), prewarm)

    # -- outcomes --------------------------------------------------------------------------
    def sleep_done(self, name: str, ok: bool, seconds: float, now: float) -> None:
        """A model went to sleep (ok), or could not (it had work after all: resident again)."""
        v = self.models[name]
        v.draining_for = None
        if not ok:
            v.state = RESIDENT
            return
        v.state = ASLEEP
        if v.in_flight > v.running:  # its waiters (arrived while it drained) wait for a wake from now on
            v.waiting_since = now
        v.sleeps += 1
        v.sleep_seconds += seconds
        v.sleep_cost_s = seconds
        self.policy.on_sleep(v, now, self.demand)

    def victims_done(self, plan: WakePlan) -> bool:
        """Whether the plan's model may load now: every victim asleep. If one stayed resident
        the plan is off and its model asleep again (its requests plan anew)."""
        m = self.models[plan.model]
        if all(self.models[v].state is ASLEEP for v in plan.victims):
            m.loading = True
            return True
        m.state, m.loading, m.prewarming = ASLEEP, False, False
        return False

    def wake_done(self, name: str, ok: bool, seconds: float, now: float) -> None:
        m = self.models[name]
        prewarm, m.loading, m.prewarming = m.prewarming, False, False
        if not ok:
            m.state = ASLEEP
            m.failed_wakes += 1
            m.failed_wake_at = now
            return
        m.failed_wake_at = None
        m.state = RESIDENT
        m.waiting_since = None
        m.wakes += 1
        m.prewarms += prewarm
        m.wake_seconds += seconds
        m.wake_cost_s = seconds
        self.policy.on_wake(m, now, self.demand, prewarm)

    def snapshot(self, now: float) -> list[dict]:
        return [{
            "model": m.name, "state": m.state.value, "in_flight": m.in_flight, "running": m.running,
            "draining_for": m.draining_for,
            "bytes": m.footprint.total, "weight_bytes": m.footprint.weight_bytes,
            "kv_cache_bytes": m.footprint.kv_cache_bytes, "overhead_bytes": m.footprint.overhead_bytes, "wakes": m.wakes, "prewarms": m.prewarms,
            "sleeps": m.sleeps, "failed_wakes": m.failed_wakes, "wake_cost_s": round(m.wake_cost_s, 3),
            "sleep_cost_s": round(m.sleep_cost_s, 3),
            "arrival_rate": round(self.demand.rate(m.name, now), 4),
        } for m in self.models.values()]  # fmt: skip
