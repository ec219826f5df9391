"""Seven models on one GPU under a budget of 60 % of their weights (issue 21).

Two 8B, two 3B, two 1B and one 14B Llama shape (dummy weights, bf16, a 4 GiB KV cache each,
sleep mode on) start side by side; the placement controller (llmserve/placement, the demand
policy) puts to sleep what exceeds the budget, then one mixed trace (Zipf popularity, bursts,
a drift of popularity) runs twice: with placement (a request for a sleeping model waits for its
wake, at most 60 s), and static (the most requested models that fit stay resident, requests
for the others are refused). Greedy tokens of every model are checked before and after.
Writes $OUT/placement_run.json after each phase.

    DURATION=180 RATE=4 python3 scripts/gpu/placement_run.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wake_costs import model_dir  # noqa: E402 - the shapes' config folders

from llmserve import EngineArgs, SamplingParams  # noqa: E402
from llmserve.engine.async_engine import AsyncEngine  # noqa: E402
from llmserve.placement.controller import PlacementController, WakeTimeout  # noqa: E402
from llmserve.placement.engine_actuator import EngineActuator  # noqa: E402
from llmserve.placement.footprint import Footprint  # noqa: E402
from llmserve.placement.model_state import ModelState, PlacedModel  # noqa: E402
from llmserve.placement.placement import Placement  # noqa: E402
from llmserve.placement.policies import make_policy  # noqa: E402
from llmserve.placement.simulator import TraceSpec, make_trace  # noqa: E402

MODELS = {"llama-8b-a": "8b", "llama-8b-b": "8b", "llama-3b-a": "3b", "llama-3b-b": "3b",
          "llama-1b-a": "1b", "llama-1b-b": "1b", "llama-14b": "14b"}  # fmt: skip
KV_BYTES = 4 << 30
SLO_S = float(os.environ.get("SLO", "2.0"))
DRAIN_S = float(os.environ.get("DRAIN", "5.0"))  # negative: never drain
DURATION = float(os.environ.get("DURATION", "180"))
RATE = float(os.environ.get("RATE", "4"))
PROMPT_LEN, MAX_TOKENS = 256, 128
CHECK_PROMPT = {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}
OUT = os.environ.get("OUT", "out")
RESULT: dict = {
    "date": time.strftime("%Y-%m-%d"),
    "duration_s": DURATION,
    "rate": RATE,
    "slo_ttft_s": SLO_S,
    "drain_after_s": DRAIN_S,
}


def save() -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "placement_run.json"), "w") as f:
        json.dump(RESULT, f, indent=1)


def used_gib() -> float:
    if not torch.cuda.is_available():  # a check of this script on a CPU (toy shapes)
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def start_engine(name: str, seed: int) -> AsyncEngine:
    shape = MODELS[name] if torch.cuda.is_available() else "toy"
    args = EngineArgs(model=model_dir(shape), load_format="dummy", max_model_len=2048, seed=seed,
                      kv_cache_memory_bytes=KV_BYTES if torch.cuda.is_available() else 8 << 20, max_num_seqs=128, enable_sleep_mode=True,
                      served_model_name=name)  # fmt: skip
    return AsyncEngine.from_engine_args(args)


async def check_tokens(engines: dict[str, AsyncEngine]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = {}
    for name, engine in engines.items():
        async for o in engine.generate(CHECK_PROMPT, params):
            last = o
        out[name] = list(last.outputs[0].token_ids)
    return out


def _p99(values: list[float]) -> float | None:
    values = sorted(values)
    return round(values[int(0.99 * (len(values) - 1))], 3) if values else None


class Run:
    def __init__(self, engines, controller: PlacementController | None, static: set[str] | None) -> None:
        self.engines, self.controller, self.static = engines, controller, static
        self.rows: list[dict] = []
        self.memory: list[float] = []

    async def one(self, t_arrive: float, model: str, start: float, seed: int) -> None:
        await asyncio.sleep(max(0.0, start + t_arrive - time.perf_counter()))
        arrived = time.perf_counter()
        row = {"model": model, "t": round(t_arrive, 3), "status": "ok", "ttft_s": None, "tokens": 0}
        self.rows.append(row)
        if self.static is not None and model not in self.static:
            row["status"] = "refused"
            return
        if self.controller is not None:
            try:
                await self.controller.acquire(model)
            except WakeTimeout:
                row["status"] = "refused"
                return
        try:
            rng = random.Random(seed)
            prompt = {"prompt_token_ids": [rng.randrange(10, 900) for _ in range(PROMPT_LEN)]}
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for o in self.engines[model].generate(prompt, params):
                if row["ttft_s"] is None and o.outputs[0].token_ids:
                    row["ttft_s"] = round(time.perf_counter() - arrived, 4)
                row["tokens"] = len(o.outputs[0].token_ids)
        except Exception as exc:  # noqa: BLE001 - counted as failed, never silently
            row["status"] = f"failed: {type(exc).__name__}: {exc}"
        finally:
            if self.controller is not None:
                self.controller.release(model)

    async def sample_memory(self) -> None:
        while True:
            self.memory.append(used_gib())
            await asyncio.sleep(0.5)

    async def go(self, trace) -> dict:
        start = time.perf_counter()
        sampler = asyncio.create_task(self.sample_memory())
        await asyncio.gather(*(self.one(t, m, start, i) for i, (t, m) in enumerate(trace)))
        wall = time.perf_counter() - start
        sampler.cancel()
        ok = [r for r in self.rows if r["status"] == "ok"]
        ttfts = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
        failed = [r for r in self.rows if r["status"].startswith("failed")]
        return {
            "requests": len(self.rows),
            "served": len(ok),
            "refused": sum(r["status"] == "refused" for r in self.rows),
            "failed": len(failed),
            "failures": [r["status"] for r in failed][:5],
            "slo_attainment": round(sum(t <= SLO_S for t in ttfts) / max(1, len(self.rows)), 4),
            "slo_attainment_of_served": round(sum(t <= SLO_S for t in ttfts) / max(1, len(ttfts)), 4),
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_p99_s": round(ttfts[int(0.99 * (len(ttfts) - 1))], 3) if ttfts else None,
            "output_tokens": sum(r["tokens"] for r in self.rows),
            "wall_s": round(wall, 1),
            "output_tok_per_s": round(sum(r["tokens"] for r in self.rows) / wall, 1),
            "device_used_gib_mean": round(statistics.mean(self.memory), 2) if self.memory else None,
            "device_used_gib_peak": round(max(self.memory), 2) if self.memory else None,
            "by_model": {
                m: {
                    "requests": sum(r["model"] == m for r in self.rows),
                    "served": sum(r["model"] == m and r["status"] == "ok" for r in self.rows),
                    "ttft_p99_s": _p99([r["ttft_s"] for r in ok if r["model"] == m and r["ttft_s"] is not None]),
                }
                for m in MODELS
            },  # fmt: skip
        }


async def main() -> None:
    t0 = time.perf_counter()
    base = used_gib()
    with concurrent.futures.ThreadPoolExecutor(len(MODELS)) as pool:
        futures = {name: pool.submit(start_engine, name, i) for i, name in enumerate(MODELS)}
        engines = {name: f.result() for name, f in futures.items()}
    RESULT["start_all_s"] = round(time.perf_counter() - t0, 1)
    RESULT["device_used_gib_all_awake"] = round(used_gib() - base, 2)
    rows = {name: await e.memory_footprint() for name, e in engines.items()}
    RESULT["footprints_gib"] = {n: round((r["weight_bytes"] + r["kv_cache_bytes"]) / 2**30, 2) for n, r in rows.items()}
    weights = sum(r["weight_bytes"] for r in rows.values())
    budget = int(0.6 * weights)
    if not torch.cuda.is_available():  # toy shapes: their KV cache dominates; room for two or three
        budget = int(2.5 * max(r["weight_bytes"] + r["kv_cache_bytes"] for r in rows.values()))
    RESULT.update(weights_gib=round(weights / 2**30, 2), budget_gib=round(budget / 2**30, 2))
    print("started", json.dumps(RESULT), flush=True)
    before = await check_tokens(engines)
    save()

    wakes: dict[str, list[float]] = {n: [] for n in MODELS}
    sleeps: dict[str, list[float]] = {n: [] for n in MODELS}

    def on_event(model: str, event: str, seconds: float) -> None:
        (sleeps if event == "sleep" else wakes)[model].append(round(seconds, 3)) if event != "wake_failed" else None

    placed = [PlacedModel(n, Footprint.from_row(r),
                          ModelState.RESIDENT) for n, r in rows.items()]  # fmt: skip
    RESULT["overheads_gib"] = {m.name: round(m.footprint.overhead_bytes / 2**30, 2) for m in placed}
    placement = Placement(
        placed, budget, make_policy("demand", slo_ttft_s=SLO_S), drain_after_s=DRAIN_S if DRAIN_S >= 0 else None
    )
    controller = PlacementController(placement, EngineActuator(engines), wake_timeout_s=60.0, on_event=on_event)
    t1 = time.perf_counter()
    await controller.fit()
    RESULT["fit_s"] = round(time.perf_counter() - t1, 2)
    RESULT["resident_after_fit"] = [m.name for m in placed if m.state is ModelState.RESIDENT]
    RESULT["device_used_gib_after_fit"] = round(used_gib() - base, 2)
    print("fit", RESULT["fit_s"], RESULT["resident_after_fit"], RESULT["device_used_gib_after_fit"], flush=True)
    save()

    spec = TraceSpec("mixed", DURATION, RATE, bursts=True, burst_every_s=DURATION / 3, burst_len_s=15.0,
                     burst_rate=RATE, diurnal=True, period_s=DURATION)  # fmt: skip
    trace = make_trace(spec, list(MODELS), seed=1)
    RESULT["trace_requests"] = len(trace)
    loop = asyncio.create_task(controller.run())
    dynamic = await Run(engines, controller, None).go(trace)
    loop.cancel()
    dynamic["wakes_per_model"] = {n: len(v) for n, v in wakes.items()}
    dynamic["wake_s_per_model"] = wakes
    dynamic["sleep_s_per_model"] = sleeps
    dynamic["wakes"] = sum(len(v) for v in wakes.values())
    dynamic["prewarms"] = sum(m.prewarms for m in placed)
    RESULT["placement"] = dynamic
    print("placement", json.dumps({k: v for k, v in dynamic.items() if not k.endswith("per_model")}), flush=True)
    save()

    # static: the most requested models that fit stay, the others sleep and their requests are refused
    counts = {n: sum(m == n for _, m in trace) for n in MODELS}
    keep, used = set(), 0
    for n in sorted(MODELS, key=lambda n: -counts[n]):
        size = next(m.footprint.total for m in placed if m.name == n)
        if used + size <= budget:
            keep.add(n)
            used += size
    for n in MODELS:
        if n not in keep:
            await engines[n].sleep(1)
    for n in keep:
        await engines[n].wake_up()
    RESULT["static_resident"] = sorted(keep)
    static = await Run(engines, None, keep).go(trace)
    RESULT["static"] = static
    print("static", json.dumps({k: v for k, v in static.items() if k != "by_model"}), flush=True)
    for n in MODELS:
        await engines[n].wake_up()
    after = await check_tokens(engines)
    RESULT["tokens_equal_after_all_wakes"] = {n: before[n] == after[n] for n in MODELS}
    save()
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
