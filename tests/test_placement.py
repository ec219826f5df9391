"""Placement of many models under one memory budget: the decisions (budget, never evicting a
busy model, the policies), the controller with requests waiting for wakes, and four real
engines of which two fit."""

from __future__ import annotations

import asyncio
import random

import pytest

from llmserve import AsyncEngine, EngineArgs, SamplingParams
from llmserve.placement.controller import PlacementController, WakeTimeout
from llmserve.placement.demand import ArrivalRate
from llmserve.placement.engine_actuator import EngineActuator
from llmserve.placement.footprint import Footprint, parse_budget
from llmserve.placement.model_state import ModelState, PlacedModel
from llmserve.placement.placement import Placement
from llmserve.placement.policies import LRU, LRUPrewarm, QLearning, make_policy

pytestmark = pytest.mark.integration

RESIDENT, ASLEEP, WAKING, SLEEPING = ModelState.RESIDENT, ModelState.ASLEEP, ModelState.WAKING, ModelState.SLEEPING


def _models(n: int, size: int = 100, asleep: tuple[str, ...] = ()) -> list[PlacedModel]:
    return [PlacedModel(name, Footprint(size - 10, 10), ASLEEP if name in asleep else RESIDENT)
            for name in "abcdefgh"[:n]]  # fmt: skip


@pytest.mark.parametrize(("value", "total", "want"), [
    (1000, None, 1000), (0.5, 800, 400), ("25%", 800, 200), ("2GiB", None, 2 << 30), ("1.5 GB", None, 1_500_000_000),
    ("512MiB", None, 512 << 20), (1, 800, 800),
])  # fmt: skip
def test_budget_settings(value, total, want):
    assert parse_budget(value, total) == want


@pytest.mark.parametrize("value", [0.0, 1.5, "12 parsecs", "abc", True, -0.2, "150%"])
def test_bad_budgets_are_refused(value):
    with pytest.raises(ValueError):
        parse_budget(value, 1000)


def test_a_model_larger_than_the_budget_is_refused_at_start():
    with pytest.raises(ValueError, match="never"):
        Placement(_models(2, size=300), budget_bytes=250)


def test_fit_then_wake_on_demand_puts_the_least_recently_used_idle_model_to_sleep():
    p = Placement(_models(4), budget_bytes=250)
    for i, name in enumerate("abcd"):
        p.models[name].last_used = float(i)
    assert p.plan_fit(now=10) == ["a", "b"]  # the two used longest ago
    for name in "ab":
        p.sleep_done(name, True, 0.1, 10)
    assert p.committed_bytes == 200 and p.device_bytes == 200
    assert p.arrive("a", 11) is False and [m.name for m in p.waiting()] == ["a"]
    plan = p.plan_wake("a", 11)
    assert plan.victims == ("c",) and not plan.prewarm  # c was used before d
    assert p.models["c"].state is SLEEPING and p.models["a"].state is WAKING
    assert p.device_bytes == 200  # a's weights are not moving yet: c still holds its memory
    p.sleep_done("c", True, 0.1, 11.1)
    assert p.victims_done(plan) and p.device_bytes == 200
    p.wake_done("a", True, 0.5, 11.6)
    assert p.models["a"].state is RESIDENT and p.models["a"].wakes == 1 and p.models["a"].wake_cost_s == 0.5
    assert p.committed_bytes <= p.budget_bytes


def test_a_busy_model_is_never_put_to_sleep():
    p = Placement(_models(3, asleep=("c",)), budget_bytes=250)
    p.arrive("a", 1)
    p.arrive("b", 1)
    p.arrive("c", 2)
    assert p.plan_wake("c", 2) is None  # a and b both have requests in flight
    p.depart("b", 3)
    plan = p.plan_wake("c", 3)
    assert plan.victims == ("b",)
    assert p.plan_wake("c", 3) is None  # planned once


def test_a_victim_that_cannot_sleep_calls_the_wake_off():
    p = Placement(_models(2, asleep=("b",)), budget_bytes=150)
    p.arrive("b", 1)
    plan = p.plan_wake("b", 1)
    p.sleep_done("a", False, 0.0, 1.1)  # the engine had work after all
    assert not p.victims_done(plan)
    assert p.models["a"].state is RESIDENT and p.models["b"].state is ASLEEP
    assert [m.name for m in p.waiting()] == ["b"]  # its request plans again


@pytest.mark.parametrize("drain_after_s", [None, 2.0])
def test_random_operations_keep_the_budget_and_spare_busy_models(drain_after_s):
    """Arrivals, starts, departures, give-ups and plan outcomes in random order: the device
    never holds more than the budget, no model with a request running goes to sleep, counts
    stay consistent; with drains too."""
    rng = random.Random(7)
    for policy in (LRU(), LRUPrewarm(horizon_s=5.0), QLearning(seed=1), make_policy("demand")):
        models = _models(5, asleep=("c", "d", "e"))
        for m, size in zip(models, (100, 60, 40, 120, 80)):  # sizes differ: a wake may need 0, 1 or 2 victims
            m.footprint = Footprint(size - 10, 10, overhead_bytes=2)
        p = Placement(models, budget_bytes=260, policy=policy, drain_after_s=drain_after_s)
        assert p.fixed_bytes == 10
        plans, now, drained = [], 0.0, 0
        for _ in range(4000):
            now += rng.random()
            op = rng.random()
            name = rng.choice("abcde")
            if op < 0.25:
                p.arrive(name, now)
            elif op < 0.35:
                waiting = [m.name for m in p.models.values() if m.in_flight > m.running]
                if waiting:
                    w = rng.choice(waiting)
                    if rng.random() < 0.8:
                        p.start(w)  # runs only if runnable
                    else:
                        p.depart(w, now, ran=False)  # gave up waiting
            elif op < 0.55:
                busy = [m.name for m in p.models.values() if m.running]
                if busy:
                    p.depart(rng.choice(busy), now)
            elif op < 0.8:
                p.clear_stale_drains()
                new = [p.plan_wake(m.name, now) for m in p.waiting()] + [p.plan_prewarm(now)]
                drained += sum(m.draining_for is not None for m in p.models.values())
                for plan in filter(None, new):
                    # planned victims run nothing (an arrival after the plan waits on them)
                    assert all(p.models[v].state is SLEEPING and not p.models[v].running for v in plan.victims)
                    plans.append(plan)
            elif plans:
                plan = plans.pop(rng.randrange(len(plans)))
                for v in plan.victims:
                    p.sleep_done(v, rng.random() < 0.9, 0.1, now)
                if p.victims_done(plan):
                    assert p.device_bytes <= p.budget_bytes
                    p.wake_done(plan.model, rng.random() < 0.95, rng.uniform(0.1, 3), now)
            sleeping = sum(m.footprint.total for m in p.models.values() if m.state is SLEEPING)
            assert p.committed_bytes + p.fixed_bytes - sleeping <= p.budget_bytes and p.device_bytes <= p.budget_bytes
            assert all(0 <= m.running <= m.in_flight for m in p.models.values())
            assert all(m.state in (RESIDENT, SLEEPING) for m in p.models.values() if m.running)
        assert sum(m.wakes for m in p.models.values()) > 10
        assert (drained > 0) == (drain_after_s is not None)


def test_a_waiting_request_drains_a_busy_model_which_then_sleeps():
    """Two models, room for one, the resident one never idle: without drains the waiting
    model would wait as long as traffic lasts; with them, after `drain_after_s` the busy model
    takes no new request, sleeps once its running ones finish, and the waiting one wakes."""
    p = Placement(_models(2, asleep=("b",)), budget_bytes=150, drain_after_s=2.0)
    assert p.arrive("a", 0.0) and p.arrive("b", 0.5) is False
    assert p.plan_wake("b", 1.0) is None and p.models["a"].draining_for is None  # too early to drain
    assert p.plan_wake("b", 2.6) is None and p.models["a"].draining_for == "b"  # a is busy: drained
    assert p.arrive("a", 2.7) is False and not p.start("a")  # a's new request waits
    assert p.plan_wake("b", 2.8) is None  # a still runs one
    p.depart("a", 3.0)
    plan = p.plan_wake("b", 3.0)
    assert plan is not None and plan.victims == ("a",)
    p.sleep_done("a", True, 0.1, 3.1)
    assert p.models["a"].draining_for is None and p.victims_done(plan)
    p.wake_done("b", True, 0.2, 3.3)
    assert p.start("b") and [m.name for m in p.waiting()] == ["a"]  # a's waiter plans its own wake
    p.depart("b", 4.0)
    assert p.plan_wake("a", 4.0).victims == ("b",)


def test_a_drain_decided_by_the_demand_policy_is_carried_out():
    """The demand policy declines wakes that displace more requests than they serve. Once a
    drain was decided for a model, its wake is not asked again when the drained model's own
    requests (waiting, still counted in its rate) would tip the balance: the wake happens."""
    demand = ArrivalRate(half_life_s=30)
    p = Placement(_models(2, asleep=("b",)), budget_bytes=150, policy=make_policy("demand", slo_ttft_s=0.1),
                  demand=demand, drain_after_s=1.0)  # fmt: skip
    for m in p.models.values():
        m.wake_cost_s = m.sleep_cost_s = 1.0  # a sleep and wake break the 0.1 s target: a's requests count
    assert p.arrive("a", 0.0) and not p.arrive("b", 0.0)
    assert p.plan_wake("b", 1.5) is None and p.models["a"].draining_for == "b"  # equal rates: drained
    for t in (1.6, 1.7, 1.8):  # a's new requests wait (and raise a's rate above b's)
        assert p.arrive("a", t) is False
    p.depart("a", 2.0)
    plan = p.plan_wake("b", 2.0)
    assert plan is not None and plan.victims == ("a",)


def test_a_drain_covers_again_when_an_idle_model_takes_a_request():
    """Drained models include the idle ones (they take no new request); if memory still falls
    short, the next plan drains more."""
    models = _models(4, asleep=("c",))
    for m in models:
        m.footprint = Footprint(9, 1) if m.name != "c" else Footprint(18, 2)
    p = Placement(models, budget_bytes=30, drain_after_s=1.0)  # a, b, d resident (10 each); c needs 20
    assert p.arrive("a", 0.0) and p.arrive("d", 0.0) and not p.arrive("c", 0.0)
    assert p.plan_wake("c", 1.5) is None
    drained = {m.name for m in p.models.values() if m.draining_for == "c"}
    assert len(drained) == 2 and "b" in drained  # the idle b and one busy model
    assert p.arrive("b", 1.6) is False  # b is drained: its request waits
    busy = next(n for n in drained if n != "b")
    p.depart(busy, 2.0)
    plan = p.plan_wake("c", 2.0)
    assert plan is not None and set(plan.victims) == drained


def test_controller_a_waiter_on_a_drained_model_runs_when_the_drain_ends():
    """a is busy and drained for b; b's request gives up; the request waiting on a must run
    (the drain's end signals it), not time out."""

    async def main():
        p = Placement(_models(2, asleep=("b",)), budget_bytes=150, drain_after_s=0.05)
        ctl = PlacementController(p, RecordingActuator(), wake_timeout_s=0.3, prewarm_interval_s=0.02)
        loop = asyncio.create_task(ctl.run())
        await ctl.acquire("a")
        b = asyncio.create_task(ctl.acquire("b"))
        await asyncio.sleep(0.15)
        assert p.models["a"].draining_for == "b"
        second = asyncio.create_task(ctl.acquire("a"))  # waits: a is drained
        with pytest.raises(WakeTimeout):
            await b
        await asyncio.wait_for(second, 0.5)  # the drain ended with b's request: a runs it
        assert p.models["a"].running == 2 and p.models["a"].draining_for is None
        ctl.release("a")
        ctl.release("a")
        loop.cancel()
        await ctl.close()

    asyncio.run(main())


def test_a_failed_wake_waits_before_the_next_try():
    p = Placement(_models(2, asleep=("b",)), budget_bytes=250)
    p.arrive("b", 0.0)
    plan = p.plan_wake("b", 0.0)
    assert p.victims_done(plan)
    p.wake_done("b", False, 0.1, 0.1)
    assert p.plan_wake("b", 0.5) is None  # backing off
    assert p.plan_wake("b", 1.2) is not None


def test_a_drain_ends_when_its_model_no_longer_waits():
    p = Placement(_models(2, asleep=("b",)), budget_bytes=150, drain_after_s=1.0)
    p.arrive("a", 0.0)
    p.arrive("b", 0.0)
    p.plan_wake("b", 1.5)
    assert p.models["a"].draining_for == "b" and p.arrive("a", 1.6) is False
    p.depart("b", 2.0, ran=False)  # b's request gave up
    assert p.clear_stale_drains() and p.models["a"].draining_for is None
    assert p.start("a")  # the request that waited on a runs


def test_overheads_count_against_the_budget_asleep_too():
    models = _models(3)
    for m in models:
        m.footprint = Footprint(90, 10, overhead_bytes=20)
    p = Placement(models, budget_bytes=300)
    assert p.fixed_bytes == 60 and p.plan_fit(0.0) != []
    assert len([m for m in p.models.values() if m.state is SLEEPING]) == 1  # 60 + 200 fit, 60 + 300 do not
    with pytest.raises(ValueError, match="asleep too"):  # 100 of one model + 60 held by all: 159 is too small
        Placement([PlacedModel(m.name, Footprint(90, 10, 20)) for m in _models(3)], budget_bytes=159)


def test_lru_prewarm_wakes_a_model_whose_requests_are_due():
    demand = ArrivalRate(half_life_s=30)
    p = Placement(_models(3, asleep=("c",)), budget_bytes=250, policy=LRUPrewarm(horizon_s=60), demand=demand)
    assert p.plan_prewarm(0.0) is None  # nobody has asked for anything
    for t in range(0, 40, 4):  # c is asked for every 4 s (and each request finishes)
        p.arrive("c", float(t))
        p.depart("c", float(t) + 0.5)
    p.arrive("b", 40.0)  # b is busy; a idle, never asked for
    plan = p.plan_prewarm(41.0)
    assert plan == type(plan)("c", ("a",), True)


def test_q_learning_learns_which_sleeps_cost_a_wake():
    """Model a is asked for often and again soon after each sleep, model b seldom and never
    after a sleep. Each time a was idle longer than b, so LRU puts a to sleep first; after
    some episodes the learned policy puts b to sleep first."""
    policy = QLearning(epsilon=0.0, alpha=0.3)
    p = Placement(_models(3, asleep=("c",)), budget_bytes=250, policy=policy)
    a, b = p.models["a"], p.models["b"]
    now = 0.0
    for episode in range(40):
        for t in range(0, 60, 6):  # a's requests: one every 6 s
            p.arrive("a", now + t)
            p.depart("a", now + t + 1)
        now += 80.0
        a.last_used, b.last_used = now - 20, now - 5
        victim = p.models["ab"[episode % 2]]
        victim.state = SLEEPING
        p.sleep_done(victim.name, True, 0.1, now)
        if victim is a:
            p.arrive("a", now + 2.0)  # its sleep cost a wake
            p.depart("a", now + 2.5)
        victim.state = RESIDENT
        now += 1000.0  # b's sleep expires with no cost
        policy.prewarm([], [], 0, now, p.demand)
    for t in range(0, 60, 6):
        p.arrive("a", now + t)
        p.depart("a", now + t + 1)
    now += 80.0
    a.last_used, b.last_used = now - 20, now - 5
    assert LRU().eviction_order([a, b], now, p.demand) == [a, b]
    assert policy.eviction_order([a, b], now, p.demand) == [b, a]
    assert policy.q_sleep[policy.state(a, now, p.demand)] < -0.5  # about minus a's wake cost, 1 s


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="lru_prewarm"):
        make_policy("fifo")


class RecordingActuator:
    """An actuator whose sleeps and wakes take a set time; it records what it was asked."""

    def __init__(self, wake_s: float = 0.05, busy: set[str] | None = None):
        self.calls: list[tuple[str, str]] = []
        self.wake_s = wake_s
        self.busy = busy or set()

    async def sleep(self, name: str, level: int) -> bool:
        self.calls.append(("sleep", name))
        await asyncio.sleep(0.01)
        return name not in self.busy

    async def wake(self, name: str) -> None:
        self.calls.append(("wake", name))
        await asyncio.sleep(self.wake_s)


def test_controller_wakes_for_a_request_and_times_out_when_nothing_can_sleep():
    async def main():
        p = Placement(_models(3, asleep=("c",)), budget_bytes=250)
        actuator = RecordingActuator()
        ctl = PlacementController(p, actuator, wake_timeout_s=0.5)
        await ctl.acquire("a")  # resident: at once
        await ctl.acquire("b")
        with pytest.raises(WakeTimeout) as err:
            await ctl.acquire("c")  # a and b are busy until released
        assert err.value.retry_after_s >= 1 and p.models["c"].in_flight == 0
        waiter = asyncio.create_task(ctl.acquire("c"))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        ctl.release("a")  # a is idle now: it sleeps, c wakes
        await asyncio.wait_for(waiter, 2)
        assert actuator.calls == [("sleep", "a"), ("wake", "c")]
        assert p.models["c"].state is RESIDENT and p.models["c"].in_flight == 1
        assert p.models["a"].state is ASLEEP
        ctl.release("c")
        ctl.release("b")
        await ctl.close()

    asyncio.run(main())


def test_controller_many_waiters_share_one_wake_and_a_busy_engine_is_retried():
    async def main():
        p = Placement(_models(2, asleep=("b",)), budget_bytes=150)
        actuator = RecordingActuator(busy={"a"})
        ctl = PlacementController(p, actuator, wake_timeout_s=3, prewarm_interval_s=0.05)
        loop = asyncio.create_task(ctl.run())
        waiters = [asyncio.create_task(ctl.acquire("b")) for _ in range(5)]
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waiters)  # a's engine says it is busy: b cannot wake
        actuator.busy.clear()
        await asyncio.wait_for(asyncio.gather(*waiters), 3)
        assert actuator.calls.count(("wake", "b")) == 1 and p.models["b"].in_flight == 5
        for _ in waiters:
            ctl.release("b")
        loop.cancel()
        await ctl.close()

    asyncio.run(main())


@pytest.mark.parametrize(("drain_after_s", "arenas"), [(None, False), (0.2, True)])
def test_four_engines_two_fit_mixed_traffic(model_dirs, drain_after_s, arenas):
    """Four tiny engines, a budget that fits two: concurrent mixed traffic to all four is
    served with no failed request, each model's greedy outputs as when it ran alone, at most
    two resident at any time, and every KV block and device tensor given back (with drains
    of busy models and sleep mode's arenas too)."""
    families = ["llama", "mistral", "qwen2", "qwen3"]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 3 + i, 7, 20 + i]} for i in range(3)]

    async def main():
        engines = {f: AsyncEngine.from_engine_args(EngineArgs(model=model_dirs[f], max_model_len=128,
                                                              kv_cache_memory_bytes=1 << 20, enable_sleep_mode=arenas))
                   for f in families}  # fmt: skip
        try:

            async def run(engine, prompt):
                final = None
                async for out in engine.generate(prompt, greedy):
                    final = out
                return final.outputs[0].token_ids

            want = {f: [await run(e, p) for p in prompts] for f, e in engines.items()}
            actuator = EngineActuator(engines)
            footprints = {f: await actuator.footprint(f) for f in families}
            size = max(fp.total for fp in footprints.values())
            models = [PlacedModel(f, footprints[f]) for f in families]
            placement = Placement(models, budget_bytes=int(size * 2.5), policy=LRUPrewarm(horizon_s=5),
                                  drain_after_s=drain_after_s)  # fmt: skip
            ctl = PlacementController(placement, actuator, wake_timeout_s=120, prewarm_interval_s=0.1)
            await ctl.fit()
            assert sum(m.state is RESIDENT for m in models) == 2
            peak = 0
            loop = asyncio.create_task(ctl.run())

            async def client(seed):
                nonlocal peak
                rng = random.Random(seed)
                got = []
                for _ in range(6):
                    family = rng.choice(families[:2] * 3 + families[2:])  # two popular, two not
                    i = rng.randrange(len(prompts))
                    await ctl.acquire(family)
                    try:
                        live = [f for f in families if not await engines[f].is_sleeping()]
                        peak = max(peak, len(live))
                        got.append((family, i, await run(engines[family], prompts[i])))
                    finally:
                        ctl.release(family)
                return got

            results = await asyncio.gather(*(client(s) for s in range(4)))
            loop.cancel()
            await ctl.close()
            assert sum(len(r) for r in results) == 24
            for family, i, tokens in (x for r in results for x in r):
                assert tokens == want[family][i], family
            assert peak <= 2 and sum(m.wakes for m in models) >= 2
            for f, engine in engines.items():
                row = await engine.memory_footprint()
                assert row["num_blocks_used"] == 0 and engine.stats().num_blocks_used == 0
                if await engine.is_sleeping():
                    assert row["device_bytes"] == 0 and placement.models[f].state is ASLEEP
                else:
                    assert row["device_bytes"] == footprints[f].total and placement.models[f].state is RESIDENT
        finally:
            for engine in engines.values():
                engine.shutdown()

    asyncio.run(main())


def test_simulator_against_a_trace_worked_by_hand():
    """Two models, room for one, wake 1 s, sleep 0.5 s, first token 0.1 s, 2 s per request.
    A at 0 s wakes A (nothing to put to sleep): TTFT 1.1 s. B at 10 s puts A to sleep and
    wakes B: 0.5 + 1 + 0.1 = 1.6 s. A at 20 s: 1.6 s again. Static keeps A (two requests
    against one) and refuses B."""
    from llmserve.placement.simulator import SimModel, simulate, simulate_static

    models = [SimModel(n, Footprint(90, 10), wake_s=1.0, sleep_s=0.5, ttft_s=0.1, service_s=2.0) for n in "AB"]
    trace = [(0.0, "A"), (10.0, "B"), (20.0, "A")]
    r = simulate(models, 150, LRU(), trace, "hand", 3600.0, slo_ttft_s=1.5)
    assert (r.requests, r.refused, r.slo_attainment) == (3, 0, round(1 / 3, 4))
    assert r.ttft_mean_s == round((1.1 + 1.6 + 1.6) / 3, 3) and r.ttft_p99_s == 1.6
    assert r.wakes_by_model == {"A": 2, "B": 1} and r.wakes_per_hour == 3.0
    s = simulate_static(models, 150, trace, "hand", 3600.0, slo_ttft_s=1.5)
    assert (s.refused, s.slo_attainment, s.wakes_per_hour) == (1, round(2 / 3, 4), 0.0)
    assert s.ttft_mean_s == 0.1


def test_simulator_refuses_what_waits_past_the_timeout():
    from llmserve.placement.simulator import SimModel, simulate

    # B's request comes while A serves a 30 s request: A cannot sleep, B's request gives up at 5 s
    models = [SimModel(n, Footprint(90, 10), wake_s=1.0, sleep_s=0.5, ttft_s=0.1, service_s=30.0) for n in "AB"]
    r = simulate(models, 150, LRU(), [(0.0, "A"), (2.0, "B")], "hand", 100.0, slo_ttft_s=2.0, wake_timeout_s=5.0)
    assert r.refused == 1 and r.slo_attainment == 0.5
    # with drains after 1 s, A is still busy for 30 s: a drain cannot shorten a running request
    r = simulate(models, 150, LRU(), [(0.0, "A"), (2.0, "B")], "hand", 100.0, slo_ttft_s=2.0, wake_timeout_s=5.0,
                 drain_after_s=1.0)  # fmt: skip
    assert r.refused == 1


def test_gateway_placement_settings_are_checked():
    from pydantic import ValidationError

    from llmserve.gateway.config import GatewayConfig

    grpc = {"kind": "triton", "replicas": ["grpc://127.0.0.1:1"]}
    ok = {"models": {"a": grpc, "b": grpc}, "placement": {"gpu_memory_budget": "40GiB", "models": ["a", "b"]}}
    assert GatewayConfig.model_validate(ok).placement.policy == "demand"
    bad = [
        ({**ok, "placement": {**ok["placement"], "models": ["a", "zzz"]}}, "one replica"),
        (
            {**ok, "models": {"a": grpc, "b": {**grpc, "replicas": ["grpc://127.0.0.1:1", "grpc://127.0.0.1:2"]}}},
            "one replica",
        ),
        ({**ok, "models": {"a": {**grpc, "fallback": "b"}, "b": grpc}}, "fallback"),
        ({**ok, "models": {"a": grpc, "b": grpc, "c": {**grpc, "fallback": "a"}}}, "fallback"),
        ({**ok, "placement": {**ok["placement"], "policy": "fifo"}}, "policy"),
        ({**ok, "placement": {**ok["placement"], "gpu_memory_budget": "plenty"}}, "gpu_memory_budget"),
        ({**ok, "placement": {**ok["placement"], "models": ["a", "a"]}}, "twice"),
        ({**ok, "placement": {**ok["placement"], "sleep_level": 3}}, "sleep_level"),
    ]
    for config, words in bad:
        with pytest.raises(ValidationError, match=words):
            GatewayConfig.model_validate(config)
