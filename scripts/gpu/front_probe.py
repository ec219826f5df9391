"""Where the host time before (a)'s first step on the device goes (the idle probe's front: 440-500 ms
of 12.99 s on 2026-12-04). One engine ("short" of bench_rows.py), workload (a) or (c) run RUNS times;
for the first LAUNCHES launches of each run, the host time of each part of the launch (schedule,
the step plan, the runner's rows, input build, copies, forward, sampler) and the garbage
collector's time, by timing wrappers around those methods. Also, per run: the Triton kernels
compiled during it (entries added to the Triton cache) and the allocator's device mallocs and
frees (`torch.cuda.memory_stats`): a first run that pays compiles or mallocs the warm-up missed
shows here. Writes $OUT/front_probe.json.

    RUNS=2 LAUNCHES=3 python3 scripts/gpu/front_probe.py --workload a,c
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_rows import ENGINES, bench_args, make_model_folder  # noqa: E402
from idle_probe import WORKLOADS  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
RUNS = int(os.environ.get("RUNS", "2"))
LAUNCHES = int(os.environ.get("LAUNCHES", "3"))
# launches whose forward launch and sampler call run under cProfile (its tables go to $OUT/prof_*.txt)
PROFILED = {int(x) for x in os.environ.get("PROFILE_LAUNCHES", "").split(",") if x}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="a", help="comma-separated, run in this order on one engine")
    opts = ap.parse_args()
    from llmserve import LLM, SamplingParams
    from llmserve.bench.throughput import make_prompts
    from llmserve.cli_args import engine_args_from_cli
    from llmserve.engine import engine_core, input_builder, model_runner, request_feed, sampler, scheduler, step_plan

    make_model_folder()
    llm = LLM(**vars(engine_args_from_cli(bench_args("throughput", ENGINES["short"]))))
    log: list[dict] = []
    state = {"armed": False, "launch": 0, "t0": 0.0}  # launch 0: before the first launch

    def recording() -> bool:
        return state["armed"] and state["launch"] <= LAUNCHES

    def timed(owner, name: str, label: str, profiled: bool = False) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not recording():
                return fn(*args, **kwargs)
            prof = cProfile.Profile() if profiled and state["launch"] in PROFILED else None
            t = time.perf_counter()
            try:
                if prof is None:
                    return fn(*args, **kwargs)
                return prof.runcall(fn, *args, **kwargs)
            finally:
                if prof is not None:
                    text = io.StringIO()
                    stats = pstats.Stats(prof, stream=text)
                    stats.sort_stats("tottime").print_stats(25)
                    stats.sort_stats("cumulative").print_stats(40)
                    tag = f"{state['workload']}_{state['run']}_{state['launch']}_{name}"
                    (OUT / f"prof_{tag}.txt").write_text(text.getvalue())
                log.append({"launch": state["launch"], "part": label, "ms": round(1000 * (time.perf_counter() - t), 2),
                            "at_ms": round(1000 * (t - state["t0"]), 1)})  # fmt: skip

        setattr(owner, name, wrapper)

    launch = engine_core.EngineCore.launch

    def counted_launch(self):
        if state["armed"]:
            state["launch"] += 1
        return launch(self)

    engine_core.EngineCore.launch = counted_launch
    timed(engine_core.EngineCore, "launch", "launch (all)")
    timed(engine_core.EngineCore, "add_request", "core add_request")
    timed(scheduler.Scheduler, "schedule", "schedule")
    timed(step_plan.PlanBuilder, "plan", "plan")
    timed(step_plan.RunnerRequests, "rows_for", "rows_for")
    timed(input_builder.InputBuilder, "build", "inputs build")
    timed(input_builder.BatchInputs, "to_device", "inputs to_device")
    timed(model_runner.ModelRunner, "run_step", "run_step (forward launch)", profiled=True)
    timed(sampler.Sampler, "sample_async", "sample_async", profiled=True)
    timed(request_feed.RequestFeed, "start", "feed start")
    gc_time = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time[0] = time.perf_counter()
        elif recording():
            log.append({"launch": state["launch"], "part": f"gc gen{info['generation']}",
                        "ms": round(1000 * (time.perf_counter() - gc_time[0]), 2)})  # fmt: skip

    gc.callbacks.append(on_gc)
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))

    def compiled() -> set[str]:
        return {p.name for p in cache.iterdir()} if cache.is_dir() else set()

    def mallocs() -> tuple[int, int]:
        st = torch.cuda.memory_stats()
        return st.get("num_device_alloc", 0), st.get("num_device_free", 0)

    results = {"workloads": opts.workload, "runs": []}
    jobs = [(w, run) for w in opts.workload.split(",") for run in range(RUNS)]
    for workload, run in jobs:
        n, inp, out, temperature = WORKLOADS[workload]
        # each run its own prompts (seed): a run never hits the prefix cache of the one before
        prompts, outs = make_prompts(
            n, inp, out, 0.0, llm.config.model_config.arch.vocab_size, 1 + len(results["runs"])
        )
        state.update(workload=workload, run=run)
        params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True) for o in outs]
        log.clear()
        before_kernels, before_mallocs = compiled(), mallocs()
        torch.cuda.synchronize()
        state.update(armed=True, launch=0, t0=time.perf_counter())
        start = state["t0"]
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        state["armed"] = False
        after = mallocs()
        row = {"workload": workload, "run": run, "wall_s": round(wall, 3), "output_tok_s": round(sum(outs) / wall, 1),
               "triton_compiles": sorted(compiled() - before_kernels),
               "device_mallocs": after[0] - before_mallocs[0], "device_frees": after[1] - before_mallocs[1],
               "parts": list(log)}  # fmt: skip
        results["runs"].append(row)
        print(
            f"RESULT {workload} run {run}: {row['output_tok_s']} tok/s, wall {row['wall_s']} s, "
            f"{len(row['triton_compiles'])} Triton compiles, {row['device_mallocs']} device mallocs",
            flush=True,
        )
        for part in log:
            print(f"RESULT   {part}", flush=True)
    (OUT / "front_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
