"""Why a workload leaves the GPU idle (an FP8 engine ran (a) at 65 % utilisation where bf16 ran
at 97 %): one engine (bench_rows.ENGINES[--engine], in this process), workload (a) or (c) run
several times with the fast paths of this change switched off one at a time by their module
constants, which the running engine reads at every call: the mixed-step attention split
(paged_attention.MIN_DECODES_TO_SPLIT), the two-stage argmax (argmax.TWO_STAGE_MAX_ROWS), the
batch-1 FP8 tiles in eager steps (fp8_gemm.SMALL_TILE_ROWS). Each run reports output tok/s,
the time Python's garbage collector ran, and from the engine's step timing log: steps, the
host's time to schedule and launch a step, and the time the host waited for results.
Writes $OUT/idle_probe_ENGINE.json.

    python3 scripts/gpu/idle_probe.py --engine fp8 --workload a
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_rows import ENGINES, bench_args, make_model_folder  # noqa: E402

WORKLOADS = {"a": (512, 512, 256, 0.0), "c": (1000, 1024, 128, 1.0)}
VARIANTS = ["now", "no_split", "one_stage_argmax", "old_tiles", "all_old", "now"]


def set_variant(name: str) -> None:
    from llmserve.engine import argmax
    from llmserve.kernels import paged_attention
    from llmserve.kernels import split_k_gemm as fp8_gemm

    old = name == "all_old"
    paged_attention.MIN_DECODES_TO_SPLIT = 10**9 if old or name == "no_split" else 64
    argmax.TWO_STAGE_MAX_ROWS = 0 if old or name == "one_stage_argmax" else 64
    fp8_gemm.SMALL_TILE_ROWS = 0 if old or name == "old_tiles" else 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--engine", default="fp8")
    ap.add_argument("--workload", default="a")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    opts = ap.parse_args()
    from llmserve import LLM, SamplingParams
    from llmserve.bench.throughput import make_prompts
    from llmserve.cli_args import engine_args_from_cli

    make_model_folder()
    log_path = Path(opts.out, f"steps_{opts.engine}.jsonl").resolve()
    args = vars(engine_args_from_cli(bench_args("throughput", ENGINES[opts.engine])))
    args["step_timing_log"] = str(log_path)
    llm = LLM(**args)
    n, inp, out, temperature = WORKLOADS[opts.workload]
    prompts, outs = make_prompts(n, inp, out, 0.0, llm.config.model_config.arch.vocab_size, 1)
    params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True) for o in outs]
    gc_time = [0.0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time[1] = time.perf_counter()
        elif gc_time[1]:
            gc_time[0] += time.perf_counter() - gc_time[1]

    gc.callbacks.append(on_gc)
    results = []
    for variant in opts.variants.split(","):
        set_variant(variant)
        llm.reset_prefix_cache()
        lines_before = log_path.read_text().count("\n") if log_path.exists() else 0
        gc_time[0] = 0.0
        torch.cuda.synchronize()
        start, start_wall = time.perf_counter(), time.time()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall, end_wall = time.perf_counter() - start, time.time()
        steps = [json.loads(line) for line in log_path.read_text().splitlines()[lines_before:]]
        steps = [s for s in steps if not s.get("empty")]
        host_ms = [1000 * (s["launched"] - s["launch"]) for s in steps]
        row = {"variant": variant, "wall_s": round(wall, 3), "output_tok_s": round(sum(outs) / wall, 1),
               "gc_s": round(gc_time[0], 3), "steps": len(steps),
               "host_launch_ms_mean": round(statistics.mean(host_ms), 2) if host_ms else None,
               "host_launch_ms_p90": round(sorted(host_ms)[int(0.9 * len(host_ms))], 2) if host_ms else None,
               "host_launch_s_total": round(sum(host_ms) / 1000, 3)}  # fmt: skip
        if steps and "done" in steps[0]:
            gaps = [1000 * (b["launch"] - a["done"]) for a, b in zip(steps, steps[1:]) if "done" in a]
            row["launch_after_previous_done_ms_mean"] = round(statistics.mean(gaps), 2) if gaps else None
            row.update(idle_estimate(steps, start_wall, end_wall))
        print("RESULT", json.dumps(row), flush=True)
        results.append(row)
        Path(opts.out, f"idle_probe_{opts.engine}.json").write_text(json.dumps(results, indent=1))


def idle_estimate(steps: list[dict], start_wall: float, end_wall: float) -> dict:
    """The GPU's idle time the step log shows for certain: before the first step was on the device
    (the front: checks, queueing, the first schedule), and wherever a step was launched only after
    the step before it was back on the host (split by whether the later step had prompt tokens),
    with the largest such gaps."""
    gaps = [(b["launched"] - a["done"], b) for a, b in zip(steps, steps[1:]) if b["launched"] > a["done"]]
    with_prefill = sum(g for g, b in gaps if b["prefill"])
    top = sorted(gaps, key=lambda x: -x[0])[:5]
    return {"front_ms": round(1000 * (steps[0]["launched"] - start_wall), 1),
            "idle_between_steps_s": round(sum(g for g, _ in gaps), 3), "idle_before_prefill_steps_s": round(with_prefill, 3),
            "idle_gaps": len(gaps), "largest_idle_gaps": [(round(1000 * g, 2), b["reqs"], b["tokens"], b["prefill"]) for g, b in top],
            "tail_ms": round(1000 * (end_wall - steps[-1]["done"]), 1)}  # fmt: skip


if __name__ == "__main__":
    main()
