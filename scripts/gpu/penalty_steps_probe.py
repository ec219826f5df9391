"""Where a penalised workload's extra time goes, step by step (issue 18: presence and repetition
rows 5-6 % below greedy, though the sampler's kernels cut its GPU time by 2 ms a step).
One engine (the 8B shape from setup_env, dummy weights, vLLM's offline budgets), workload (a)
(512 x 512/256) four times: greedy, presence 0.5 at T 0.8, repetition 1.1, greedy again. Per run:
the elapsed time, and per decode step (from `--step-timing-log` and timers around the runner's
calls): the launch period, the host time to schedule and launch, the runner's execute_async and
the sampler's host time, launch to done, the allocator's retries. Then where the host waits for the
device in each kind (`host_syncs`). Each run has fresh prompts. Writes $OUT/penalty_steps.json.

    python3 scripts/gpu/penalty_steps_probe.py
    PROBE_ROOT=.ab/main python3 scripts/gpu/penalty_steps_probe.py   # another tree's llmserve
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("PROBE_ROOT") or str(Path(__file__).resolve().parents[2]))

from llmserve import LLM, SamplingParams  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
VOCAB, PROMPT, N, OUTPUT = (int(os.environ.get(k, d)) for k, d in (("VOCAB", 128000), ("PROMPT", 512), ("N", 512), ("OUTPUT", 256)))
RUNS = (("a", dict(temperature=0.0)), ("presence", dict(temperature=0.8, presence_penalty=0.5)),
        ("repetition", dict(temperature=0.0, repetition_penalty=1.1)), ("a_again", dict(temperature=0.0)))  # fmt: skip


def timed(obj, name: str, sink: list) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        sink.append((start, time.perf_counter() - start))
        return out

    setattr(obj, name, wrapper)


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's retries (a free of cached blocks, then cudaMalloc again) and
    device allocations and frees so far (zeros off a GPU)."""
    import torch

    if not torch.cuda.is_available():
        return {"num_alloc_retries": 0, "num_device_alloc": 0, "num_device_free": 0}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def med(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3) if values else 0.0


def main() -> None:
    log = OUT / "steps.jsonl"
    llm = LLM(os.environ.get("PROBE_MODEL", "/tmp/llama8b"), load_format="dummy", max_model_len=2048, max_num_seqs=1024, max_num_batched_tokens=16384,
              step_timing_log=str(log))  # fmt: skip
    runner = llm.core.runner
    calls: dict[str, list] = {"execute_async": [], "sample_async": []}
    timed(runner, "execute_async", calls["execute_async"])
    timed(runner.sampler, "sample_async", calls["sample_async"])
    rng = random.Random(0)

    def fresh_prompts(n: int) -> list[dict]:  # (each run its own: no prefix-cache hits across runs)
        return [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(PROMPT)]} for _ in range(n)]

    llm.generate(fresh_prompts(4), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    result = {}
    for name, kw in RUNS:
        for sink in calls.values():
            sink.clear()
        mem = allocator_counts()
        start = time.time()
        llm.generate(fresh_prompts(N), SamplingParams(max_tokens=OUTPUT, ignore_eos=True, **kw), use_tqdm=False)
        end = time.time()
        steps = [json.loads(line) for line in log.read_text().splitlines()]
        steps = [s for s in steps if start <= s["launch"] <= end]
        decode = [s for s in steps if s["prefill"] == 0]
        period = [b["launch"] - a["launch"] for a, b in zip(decode, decode[1:])]
        result[name] = {
            "elapsed_s": round(end - start, 3), "output_tok_s": round(N * OUTPUT / (end - start), 1),
            "steps": len(steps), "decode_steps": len(decode), "decode_period_ms": med(period),
            "decode_host_launch_ms": med([s["launched"] - s["launch"] for s in decode]),
            "decode_launch_to_done_ms": med([s["done"] - s["launched"] for s in decode]),
            "execute_async_ms": med([d for _, d in calls["execute_async"]]),
            "sample_async_host_ms": med([d for _, d in calls["sample_async"]]),
            "prefill_steps_s": round(sum(s["done"] - s["launch"] for s in steps if s["prefill"] > 0), 3),
            "allocator": {k: v - mem[k] for k, v in allocator_counts().items()},
        }  # fmt: skip
        print("RESULT", name, json.dumps(result[name]), flush=True)
    result["syncs"] = {name: host_syncs(llm, fresh_prompts(64), kw) for name, kw in RUNS[:3]}
    print("RESULT syncs", json.dumps(result["syncs"]), flush=True)
    (OUT / "penalty_steps.json").write_text(json.dumps(result, indent=1))


def host_syncs(llm, prompts: list, kw: dict) -> dict[str, int]:
    """Where the host waits for the device (torch's sync debug mode, every warning kept): call
    site -> count, over a short run of 64 requests x 16 tokens (after the timed runs)."""
    import collections
    import warnings

    import torch

    if not torch.cuda.is_available():
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, **kw), use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return dict(sites.most_common(12))


if __name__ == "__main__":
    main()
