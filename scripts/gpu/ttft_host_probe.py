"""Batch-1 TTFT at PROMPT_LEN tokens (default 7,680) split into host and device time, without the
profiler (whose own overhead made "6.6 ms of host before the first kernel" on 2026-12-04): the
"long" engine of bench_rows.py, `generate()` with max_tokens=1, RUNS times. Timing wrappers give
each part's host start and length (add_request, schedule, plan, rows, inputs build, copies to the
device, the forward's launch, the sampler, the step's result); CUDA events at the model's first kernel
and after the sampler give the device's span of the step. Host before the device starts = the
forward event's time since generate() began (the device is idle until then); after = the wall time
left after the sampler's event. Writes $OUT/ttft_host_probe.json.

    PROMPT_LEN=7680 RUNS=8 python3 scripts/gpu/ttft_host_probe.py
"""

from __future__ import annotations

import functools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_rows import ENGINES, bench_args, make_model_folder  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
PROMPT_LEN = int(os.environ.get("PROMPT_LEN", 7680))
RUNS = int(os.environ.get("RUNS", 8))


def main() -> None:
    from llmserve import LLM, SamplingParams
    from llmserve.cli_args import engine_args_from_cli
    from llmserve.engine import engine_core, input_builder, model_runner, sampler, scheduler, step_plan
    from llmserve.model import llama

    make_model_folder()
    llm = LLM(**vars(engine_args_from_cli(bench_args("latency", ENGINES["long"]))))
    state = {"on": False, "t0": 0.0, "events": []}
    log: list[tuple[str, float, float]] = []

    def timed(owner, name: str, event_before: bool = False, event_after: bool = False) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not state["on"]:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            if event_before:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                state["events"].append((f"{name} start", ev, t))
            try:
                return fn(*args, **kwargs)
            finally:
                done = time.perf_counter()
                if event_after:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    state["events"].append((f"{name} end", ev, done))
                log.append((name, round(1000 * (t - state["t0"]), 3), round(1000 * (done - t), 3)))

        setattr(owner, name, wrapper)

    timed(engine_core.EngineCore, "add_request")
    timed(scheduler.Scheduler, "schedule")
    timed(step_plan.PlanBuilder, "plan")
    timed(step_plan.RunnerRequests, "rows_for")
    timed(input_builder.InputBuilder, "build")
    timed(input_builder.BatchInputs, "to_device")
    timed(model_runner.ModelRunner, "_forward", event_before=True)
    timed(llama.LlamaForCausalLM, "forward", event_before=True)  # after the inputs' copies: the first kernel
    timed(sampler.Sampler, "sample_async", event_after=True)
    timed(engine_core.EngineCore, "finish")
    timed(scheduler.Scheduler, "update_from_output")
    rng = random.Random(0)
    vocab = llm.config.model_config.arch.vocab_size
    runs = []
    for run in range(RUNS + 2):
        prompt = [rng.randrange(10, vocab) for _ in range(PROMPT_LEN)]
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        log.clear()
        state["events"] = []
        torch.cuda.synchronize()
        state.update(on=True, t0=time.perf_counter())
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        end = time.perf_counter()
        state["on"] = False
        torch.cuda.synchronize()
        events = state["events"]
        first = next(e for e in events if e[0] == "forward start")
        last = [e for e in events if e[0] == "sample_async end"][-1]
        device_ms = first[1].elapsed_time(last[1])
        wall = 1000 * (end - state["t0"])
        # the device's start: the host time the model's first event was recorded (after the
        # inputs' copies), since the device idles until then (the queue was empty at synchronize())
        before = 1000 * (first[2] - state["t0"])
        row = {"run": run, "wall_ms": round(wall, 3), "device_ms": round(device_ms, 3),
               "host_before_device_ms": round(before, 3), "after_device_ms": round(wall - before - device_ms, 3),
               "parts": list(log)}  # fmt: skip
        if run >= 2:
            runs.append(row)
        print(
            f"RESULT run {run}: wall {wall:.2f} ms = host before {before:.2f} + device {device_ms:.2f} + after "
            f"{row['after_device_ms']:.2f}",
            flush=True,
        )
        for part in log:
            print(f"RESULT   {part}", flush=True)
    if os.environ.get("PROFILE", "1") == "1":  # one more run under cProfile: where the host parts go
        import cProfile
        import io
        import pstats

        prompt = [rng.randrange(10, vocab) for _ in range(PROMPT_LEN)]
        prof = cProfile.Profile()
        prof.runcall(llm.generate, [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1,
                     ignore_eos=True), use_tqdm=False)  # fmt: skip
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(60)
        (OUT / "ttft_host_profile.txt").write_text(text.getvalue())
    summary = {k: round(statistics.median(r[k] for r in runs), 3)
               for k in ("wall_ms", "device_ms", "host_before_device_ms", "after_device_ms")}  # fmt: skip
    print(f"RESULT median of {len(runs)}: {summary}", flush=True)
    (OUT / "ttft_host_probe.json").write_text(json.dumps({"prompt_len": PROMPT_LEN, "median": summary, "runs": runs},
                                                         indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
