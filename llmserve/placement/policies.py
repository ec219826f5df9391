"""Which idle model goes to sleep when memory is needed, and which sleeping model to wake
before its requests come (pre-warm). The decisions in placement.py ask a policy these two
questions and tell it what happened, so a policy may learn.

- `LRU`: the least recently used idle model sleeps first; nothing is woken ahead.
- `LRUPrewarm`: LRU, and a sleeping model whose arrival-rate estimate says a request is due
  within `horizon_s` is woken ahead, putting to sleep only idle models with well under its
  rate.
- `QLearning`: tabular action values, one-step (each decision is scored when its outcome is
  known), epsilon-greedy. A model's state is its arrival-rate bucket, its idle-time bucket
  and its wake-cost bucket. Putting a model to sleep scores minus its wake cost when a
  request for it comes back within the horizon (discounted by how soon), pre-warming one
  scores the wake it saved (or minus its churn when nobody came). Victims are the models
  whose sleep costs least; a sleeping model is pre-warmed when waking it is worth more than
  what its victims' sleep costs.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

from llmserve.placement.demand import ArrivalRate
from llmserve.placement.model_state import PlacedModel

Choice = tuple[PlacedModel, list[PlacedModel]]  # the model to wake, and who sleeps for it


class Policy:
    """LRU eviction, no pre-warm, no learning: the base the others refine."""

    name = "lru"

    def eviction_order(self, idle: Sequence[PlacedModel], now: float, demand: ArrivalRate) -> list[PlacedModel]:
        """Idle resident models, the first to put to sleep first (a request is waiting)."""
        return sorted(idle, key=lambda m: m.last_used)

    def worth_waking(self, model: PlacedModel, victims: Sequence[PlacedModel], now: float,
                     demand: ArrivalRate) -> bool:  # fmt: skip
        """Whether to wake `model` for its waiting requests at the cost of `victims` (else its
        requests keep waiting, and time out unless demand changes)."""
        return True

    def prewarm(self, asleep: Sequence[PlacedModel], idle: Sequence[PlacedModel], free_bytes: int,
                now: float, demand: ArrivalRate) -> Choice | None:  # fmt: skip
        """A sleeping model to wake with no request waiting, and the idle models to put to sleep
        for it (their memory and `free_bytes` must cover it); None: wake nothing now."""
        return None

    # what happened, for policies that learn
    def on_sleep(self, model: PlacedModel, now: float, demand: ArrivalRate) -> None: ...

    def on_wake(self, model: PlacedModel, now: float, demand: ArrivalRate, prewarm: bool) -> None: ...

    def on_arrival(self, model: PlacedModel, now: float, demand: ArrivalRate) -> None: ...


class LRU(Policy):
    name = "lru"


def cover(need: int, candidates: Sequence[PlacedModel]) -> list[PlacedModel] | None:
    """The first candidates whose memory covers `need`; None if all of them do not."""
    victims, freed = [], 0
    for m in candidates:
        if freed >= need:
            break
        victims.append(m)
        freed += m.footprint.total
    return victims if freed >= need else None


class LRUPrewarm(Policy):
    name = "lru_prewarm"

    def __init__(self, horizon_s: float = 60.0, margin: float = 2.0) -> None:
        self.horizon_s = horizon_s  # a model expecting a request within this is worth waking
        self.margin = margin  # a victim's rate must be this many times below the woken one's

    def prewarm(self, asleep, idle, free_bytes, now, demand) -> Choice | None:
        rates = {m.name: demand.rate(m.name, now) for m in [*asleep, *idle]}
        for model in sorted(asleep, key=lambda m: -rates[m.name]):
            rate = rates[model.name]
            if rate * self.horizon_s < 1.0:
                break  # sorted: no later one is due either
            cheaper = sorted((v for v in idle if rates[v.name] * self.margin < rate),
                             key=lambda v: (rates[v.name], v.last_used))  # fmt: skip
            victims = cover(model.footprint.total - free_bytes, cheaper)
            if victims is not None:
                return model, victims
        return None


class DemandAware(LRUPrewarm):
    """Keeps the memory for the demand. The idle models that sleep first are those whose
    requests (arrival rate) times wake cost per byte is lowest. A wake waits (its requests
    time out unless its demand grows) when the models it would put to sleep get more requests
    than it does, counting only those whose sleep and wake again would break the TTFT target
    (`slo_ttft_s`): a model that is back within the target costs its requests little. With
    `starve_s`, a request that has waited that long wakes its model anyway (off by default:
    with sleeps of tens of seconds, forcing those wakes costs more requests than it saves,
    15-22 % SLO attainment instead of 52-61 % in `llmserve bench placement`).
    Pre-warms as LRUPrewarm."""

    name = "demand"

    def __init__(self, horizon_s: float = 60.0, margin: float = 2.0, protect: float = 1.0,
                 slo_ttft_s: float = 2.0, starve_s: float | None = None) -> None:  # fmt: skip
        super().__init__(horizon_s, margin)
        self.starve_s = starve_s
        self.protect = protect  # the displaced requests over the woken model's at which a wake waits
        self.slo_ttft_s = slo_ttft_s

    @staticmethod
    def _value_density(m: PlacedModel, now: float, demand: ArrivalRate) -> float:
        return demand.rate(m.name, now) * m.wake_cost_s / max(1, m.footprint.total)

    def eviction_order(self, idle, now, demand) -> list[PlacedModel]:
        return sorted(idle, key=lambda m: (self._value_density(m, now, demand), m.last_used))

    def worth_waking(self, model, victims, now, demand) -> bool:
        if self.starve_s is not None and model.waiting_since is not None and now - model.waiting_since >= self.starve_s:
            return True
        displaced = sum(demand.rate(v.name, now) for v in victims if v.sleep_cost_s + v.wake_cost_s > self.slo_ttft_s)
        return displaced <= self.protect * demand.rate(model.name, now)


RATE_EDGES = (1 / 600, 1 / 60, 1 / 10, 1.0)  # requests a second
IDLE_EDGES = (2.0, 10.0, 60.0, 300.0)  # seconds since the last request
COST_EDGES = (0.5, 2.0, 5.0)  # seconds one wake takes
State = tuple[int, int, int]


class QLearning(Policy):
    name = "q_learning"

    def __init__(self, horizon_s: float = 60.0, alpha: float = 0.1, epsilon: float = 0.05,
                 churn: float = 0.25, seed: int = 0) -> None:  # fmt: skip
        self.horizon_s = horizon_s
        self.alpha = alpha
        self.epsilon = epsilon
        self.churn = churn  # what a wake nobody used costs, as a share of its wake cost
        self.rng = random.Random(seed)
        self.q_sleep: dict[State, float] = {}  # value of putting a model in this state to sleep
        self.q_wake: dict[State, float] = {}  # value of pre-warming a sleeping model in this state
        self._slept: dict[str, tuple[State, float]] = {}  # decisions not yet scored
        self._warmed: dict[str, tuple[State, float, float]] = {}  # ... and the wake's cost

    def state(self, model: PlacedModel, now: float, demand: ArrivalRate) -> State:
        return (bisect.bisect(RATE_EDGES, demand.rate(model.name, now)),
                bisect.bisect(IDLE_EDGES, now - model.last_used),
                bisect.bisect(COST_EDGES, model.wake_cost_s))  # fmt: skip

    def _learn(self, table: dict[State, float], state: State, reward: float) -> None:
        old = table.get(state, 0.0)
        table[state] = old + self.alpha * (reward - old)

    def eviction_order(self, idle, now, demand) -> list[PlacedModel]:
        if self.rng.random() < self.epsilon:
            return self.rng.sample(list(idle), len(idle))
        return sorted(idle, key=lambda m: (-self.q_sleep.get(self.state(m, now, demand), 0.0), m.last_used))

    def prewarm(self, asleep, idle, free_bytes, now, demand) -> Choice | None:
        self._expire(now)
        explore = self.rng.random() < self.epsilon
        values = {m.name: self.q_wake.get(self.state(m, now, demand), 0.0) for m in asleep}
        order = self.rng.sample(list(asleep), len(asleep)) if explore else sorted(asleep, key=lambda m: -values[m.name])
        for model in order:
            worth = values[model.name]
            if worth <= 0.0 and not explore:
                break
            costs = {v.name: -self.q_sleep.get(self.state(v, now, demand), 0.0) for v in idle}
            cheaper = sorted((v for v in idle if explore or costs[v.name] < worth), key=lambda v: costs[v.name])
            victims = cover(model.footprint.total - free_bytes, cheaper)
            if victims is not None:
                return model, victims
        return None

    def on_sleep(self, model, now, demand) -> None:
        warmed = self._warmed.pop(model.name, None)
        if warmed is not None:  # pre-warmed and put to sleep again before anyone came
            self._learn(self.q_wake, warmed[0], -self.churn * model.wake_cost_s)
        self._slept[model.name] = (self.state(model, now, demand), now)

    def on_wake(self, model, now, demand, prewarm) -> None:
        if prewarm:
            self._warmed[model.name] = (self.state(model, now, demand), now, model.wake_cost_s)

    def on_arrival(self, model, now, demand) -> None:
        slept = self._slept.pop(model.name, None)
        if slept is not None:  # the sleep cost a wake, the sooner the more
            self._learn(self.q_sleep, slept[0], -model.wake_cost_s * math.exp(-(now - slept[1]) / self.horizon_s))
        warmed = self._warmed.pop(model.name, None)
        if warmed is not None:  # the pre-warm saved a wake
            saved = model.wake_cost_s * math.exp(-(now - warmed[1]) / self.horizon_s)
            self._learn(self.q_wake, warmed[0], saved - self.churn * model.wake_cost_s)

    def _expire(self, now: float) -> None:
        """Decisions with no outcome for three horizons: a sleep that cost nothing, a pre-warm
        nobody used."""
        late = now - 3 * self.horizon_s
        for name, (state, at) in list(self._slept.items()):
            if at < late:
                del self._slept[name]
                self._learn(self.q_sleep, state, 0.0)
        for name, (state, at, cost) in list(self._warmed.items()):
            if at < late:
                del self._warmed[name]
                self._learn(self.q_wake, state, -self.churn * cost)


POLICIES: dict[str, type[Policy]] = {"lru": LRU, "lru_prewarm": LRUPrewarm, "q_learning": QLearning,
                                     "demand": DemandAware}  # fmt: skip


def make_policy(name: str, **kwargs) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"placement policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](**kwargs)
