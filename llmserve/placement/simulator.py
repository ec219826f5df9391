"""The placement policies on synthetic request traces, in virtual time.

The decisions are placement.py's, the same the live controller makes; only the clock and the
engines are simulated. A resident model answers a request after `ttft_s` and holds it for
`service_s`; a sleeping one wakes in `wake_s` once the idle models it displaces have slept
(`sleep_s`). A request that waits longer than `wake_timeout_s` is refused, as the gateway
refuses it (503). `static` is the placement without sleep: the most requested models that
fit stay resident, requests for the others are refused.

Traces: Poisson arrivals over Zipf popularity, with bursts on one model at a time and/or a
diurnal drift (the total rate swings and popularity moves from one ranking to another).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llmserve.placement.footprint import Footprint
from llmserve.placement.model_state import ModelState, PlacedModel
from llmserve.placement.placement import Placement, WakePlan
from llmserve.placement.policies import Policy

GIB = 1 << 30


@dataclass(frozen=True)
class SimModel:
    name: str
    footprint: Footprint
    wake_s: float  # one wake from sleep
    sleep_s: float  # one sleep
    ttft_s: float  # first token when resident
    service_s: float  # how long a request holds the model


@dataclass(frozen=True)
class TraceSpec:
    name: str
    duration_s: float = 3600.0
    rate: float = 2.0  # requests a second, on average
    zipf_s: float = 1.1
    bursts: bool = False
    burst_every_s: float = 300.0  # mean gap between bursts
    burst_len_s: float = 30.0
    burst_rate: float = 3.0  # extra requests a second on the burst's model
    diurnal: bool = False
    period_s: float = 3600.0  # one "day"


def make_trace(spec: TraceSpec, names: Sequence[str], seed: int = 0) -> list[tuple[float, str]]:
    """(arrival time, model) in time order."""
    rng = random.Random(seed)
    n = len(names)
    weights = [1.0 / (k + 1) ** spec.zipf_s for k in range(n)]
    first = rng.sample(list(names), n)  # the ranking at the start of the day
    second = rng.sample(list(names), n)  # ... and half a day later

    def popularity(t: float) -> dict[str, float]:
        mix = 0.5 - 0.5 * math.cos(2 * math.pi * t / spec.period_s) if spec.diurnal else 0.0
        p = dict.fromkeys(names, 0.0)
        for rank, w in enumerate(weights):
            p[first[rank]] += (1 - mix) * w
            p[second[rank]] += mix * w
        total = sum(p.values())
        return {k: v / total for k, v in p.items()}

    burst_windows = []
    t = rng.expovariate(1 / spec.burst_every_s) if spec.bursts else math.inf
    while t < spec.duration_s:
        burst_windows.append((t, t + spec.burst_len_s, rng.choice(list(names))))
        t += spec.burst_len_s + rng.expovariate(1 / spec.burst_every_s)

    out: list[tuple[float, str]] = []
    step = 1.0
    for i in range(int(math.ceil(spec.duration_s / step))):
        t0 = i * step
        rate = spec.rate * (1 + 0.5 * math.sin(2 * math.pi * t0 / spec.period_s)) if spec.diurnal else spec.rate
        p = popularity(t0)
        models, probs = list(p), list(p.values())
        for _ in range(_poisson(rng, rate * step)):
            out.append((t0 + rng.random() * step, rng.choices(models, probs)[0]))
        for start, end, model in burst_windows:
            if start < t0 + step and end > t0:
                for _ in range(_poisson(rng, spec.burst_rate * step)):
                    out.append((t0 + rng.random() * step, model))
    out.sort()
    return out


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


@dataclass
class SimResult:
    policy: str
    trace: str
    requests: int
    slo_attainment: float  # share with TTFT under the target (refused ones miss)
    refused: int  # timed out waiting, or no place (static)
    ttft_mean_s: float
    ttft_p99_s: float
    wakes_per_hour: float
    prewarms_per_hour: float
    memory_mean_frac: float  # device memory in use over the budget, time-weighted
    memory_peak_frac: float
    wakes_by_model: dict[str, int] = field(default_factory=dict)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q / 100 * len(ordered))) - 1)]


class Simulation:
    """One run: a trace through a placement, with events in a heap of (time, order, action)."""

    def __init__(self, models: Sequence[SimModel], budget_bytes: int, policy: Policy, *,
                 slo_ttft_s: float, wake_timeout_s: float = 60.0, prewarm_interval_s: float = 1.0,
                 start_resident: Sequence[str] = (), drain_after_s: float | None = None) -> None:  # fmt: skip
        self.spec = {m.name: m for m in models}
        placed = [
            PlacedModel(m.name, m.footprint, ModelState.ASLEEP, wake_cost_s=m.wake_s, sleep_cost_s=m.sleep_s)
            for m in models
        ]
        self.placement = Placement(placed, budget_bytes, policy, drain_after_s=drain_after_s)
        for name in start_resident:
            self.placement.models[name].state = ModelState.RESIDENT
        self.slo = slo_ttft_s
        self.timeout = wake_timeout_s
        self.interval = prewarm_interval_s
        self.events: list = []
        self.order = itertools.count()
        self.now = 0.0
        self.waiting: dict[str, list[tuple[int, float]]] = {m.name: [] for m in models}  # (request, arrived)
        self.ttft: dict[int, float | None] = {}  # None: refused
        self.memory_area = 0.0
        self.memory_peak = 0

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self.order), action))

    def run(self, trace: Sequence[tuple[float, str]], duration_s: float) -> None:
        for i, (t, model) in enumerate(trace):
            self.at(t, lambda i=i, model=model: self.arrive(i, model))
        tick = 0.0
        while tick < duration_s:
            tick += self.interval
            self.at(tick, self.tick)
        while self.events:
            t, _, action = heapq.heappop(self.events)
            self.memory_area += self.placement.device_bytes * (t - self.now)
            self.now = t
            action()
            self.memory_peak = max(self.memory_peak, self.placement.device_bytes)

    # -- requests --------------------------------------------------------------------------
    def arrive(self, i: int, model: str) -> None:
        if self.placement.arrive(model, self.now):
            self.start(i, model, self.now)
            return
        self.waiting[model].append((i, self.now))
        self.at(self.now + self.timeout, lambda: self.give_up(i, model))
        self.plan()

    def start(self, i: int, model: str, arrived: float) -> None:
        spec = self.spec[model]
        self.ttft[i] = self.now - arrived + spec.ttft_s
        self.at(self.now + spec.ttft_s + spec.service_s, lambda: self.finish(model))

    def finish(self, model: str) -> None:
        self.placement.depart(model, self.now)
        self.plan()

    def give_up(self, i: int, model: str) -> None:
        if any(j == i for j, _ in self.waiting[model]):
            self.waiting[model] = [(j, a) for j, a in self.waiting[model] if j != i]
            self.ttft[i] = None
            self.placement.depart(model, self.now, ran=False)

    # -- plans -----------------------------------------------------------------------------
    def tick(self) -> None:
        self.plan()
        plan = self.placement.plan_prewarm(self.now)
        if plan is not None:
            self.execute(plan)

    def plan(self) -> None:
        self.placement.clear_stale_drains()
        for m in self.placement.waiting():
            plan = self.placement.plan_wake(m.name, self.now)
            if plan is not None:
                self.execute(plan)
        for model in self.waiting:
            self.run_waiting(model)

    def run_waiting(self, model: str) -> None:
        """Waiting requests whose model is runnable again (woken, or no longer drained) start."""
        while self.waiting[model] and self.placement.start(model):
            i, arrived = self.waiting[model].pop(0)
            self.start(i, model, arrived)

    def execute(self, plan: WakePlan) -> None:
        sleep_s = max((self.spec[v].sleep_s for v in plan.victims), default=0.0)  # they sleep at once

        def slept() -> None:
            for v in plan.victims:
                self.placement.sleep_done(v, True, self.spec[v].sleep_s, self.now)
            self.placement.victims_done(plan)
            self.at(self.now + self.spec[plan.model].wake_s, woke)

        def woke() -> None:
            self.placement.wake_done(plan.model, True, self.spec[plan.model].wake_s, self.now)
            self.run_waiting(plan.model)
            self.plan()

        self.at(self.now + sleep_s, slept)

    def result(self, policy: str, trace: str, duration_s: float) -> SimResult:
        served = [v for v in self.ttft.values() if v is not None]
        models = self.placement.models.values()
        hours = duration_s / 3600
        return SimResult(
            policy=policy, trace=trace, requests=len(self.ttft),
            slo_attainment=round(sum(v <= self.slo for v in served) / max(1, len(self.ttft)), 4),
            refused=len(self.ttft) - len(served),
            ttft_mean_s=round(sum(served) / max(1, len(served)), 3), ttft_p99_s=round(_percentile(served, 99), 3),
            wakes_per_hour=round(sum(m.wakes for m in models) / hours, 1),
            prewarms_per_hour=round(sum(m.prewarms for m in models) / hours, 1),
            memory_mean_frac=round(self.memory_area / max(self.now, 1e-9) / self.placement.budget_bytes, 3),
            memory_peak_frac=round(self.memory_peak / self.placement.budget_bytes, 3),
            wakes_by_model={m.name: m.wakes for m in models},
        )  # fmt: skip


def simulate(models: Sequence[SimModel], budget_bytes: int, policy: Policy, trace: Sequence[tuple[float, str]],
             trace_name: str, duration_s: float, slo_ttft_s: float, wake_timeout_s: float = 60.0,
             drain_after_s: float | None = None) -> SimResult:  # fmt: skip
    sim = Simulation(
        models, budget_bytes, policy, slo_ttft_s=slo_ttft_s, wake_timeout_s=wake_timeout_s, drain_after_s=drain_after_s
    )
    sim.run(trace, duration_s)
    return sim.result(policy.name, trace_name, duration_s)


def simulate_static(models: Sequence[SimModel], budget_bytes: int, trace: Sequence[tuple[float, str]],
                    trace_name: str, duration_s: float, slo_ttft_s: float) -> SimResult:  # fmt: skip
    """No sleep: the most requested models of the trace that fit (greedily, an oracle's choice)
    stay resident all along; requests for the others are refused."""
    counts = {m.name: 0 for m in models}
    for _, name in trace:
        counts[name] += 1
    resident, used = [], 0
    for m in sorted(models, key=lambda m: -counts[m.name]):
        if used + m.footprint.total <= budget_bytes:
            resident.append(m.name)
            used += m.footprint.total

    class Never(Policy):
        name = "static"

    sim = Simulation(models, budget_bytes, Never(), slo_ttft_s=slo_ttft_s, wake_timeout_s=0.0,
                     start_resident=resident)  # fmt: skip
    sim.placement.plan_wake = lambda name, now: None  # a model outside the set is never woken
    sim.run(trace, duration_s)
    return sim.result("static", trace_name, duration_s)
