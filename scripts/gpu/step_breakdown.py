"""Where the time of workloads (a), (b) and (c) goes on the H200: GPU kernel time by kind
(GEMMs, attention, sampling, norms/rotary/activation/KV writes, the rest) against the wall
time, from torch.profiler over the whole run, and the roofline of each workload.

Kinds come from kernel names (cuBLAS/CUTLASS GEMMs; llmserve's Triton attention, cuDNN or
flash attention; llmserve's fused elementwise kernels; the rest, sampling included). The
sampler's own GPU time per step is timed apart, with CUDA events, at the batch sizes the
workloads run. Host time is wall time minus the time the GPU was busy (kernels on one
stream), i.e. when the GPU waited on Python. The profiler slows the host a little: ratios,
not absolutes.

    python3 scripts/gpu/step_breakdown.py --out $OUT [--only a,b,c] [--engine fp8] [--no-sampler]

Each workload also lists its kernels by total GPU time (`top_kernels`: name, calls, total and
mean microseconds), so a row's cost can be traced to one kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_rows import ENGINES, bench_args, make_model_folder  # noqa: E402

WORKLOADS = {
    "a": dict(n=512, inp=512, out=256, temperature=0.0),
    "b": dict(n=1, inp=512, out=256, temperature=1.0),
    "c": dict(n=1000, inp=1024, out=128, temperature=1.0),
}
PEAK_TFLOPS, PEAK_TBPS = 744.0, 4.15  # measured on this H200: bf16 8192^3 matmul, device copy (GPU_NOTES.md)


def kind_of(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk")):
        return "gemm"
    if any(s in n for s in ("_paged_attn", "_reduce_splits", "flash", "cudnn", "fmha", "attention")):
        return "attention"
    if any(s in n for s in ("rms", "rotary", "silu", "write_kv", "_kv_kernel", "norm")):
        return "norm_rotary_act_kv"
    return "other"


def breakdown(prof, wall_s: float, top: int = 25) -> dict:
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    busy = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        busy += us
        by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + us
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ms = {k: round(v / 1000, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    kernels = [{"name": name, "calls": n, "total_us": round(us, 1), "mean_us": round(us / n, 2)}
               for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]  # fmt: skip
    return {"wall_ms": round(wall_s * 1000, 1), "gpu_busy_ms": round(busy / 1000, 1),
            "host_ms": round(wall_s * 1000 - busy / 1000, 1), "by_kind_ms": ms, "top_kernels": kernels}  # fmt: skip


def sampler_ms(vocab: int) -> dict:
    """The batched sampler's GPU time for one step: greedy, temperature 1, top-k/top-p and
    penalties, at 1, 512 and 1000 rows (CUDA events, median of 20)."""
    from llmserve.engine.request import EngineCoreRequest, Request
    from llmserve.engine.sampler import Sampler
    from llmserve.sampling_params import SamplingParams

    out = {}
    kinds = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0),
             "topk50_topp": dict(temperature=0.8, top_k=50, top_p=0.95),
             "presence": dict(temperature=0.8, presence_penalty=0.5)}  # fmt: skip
    for rows in (1, 512, 1000):
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        for name, kw in kinds.items():
            reqs = [Request(EngineCoreRequest(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=8, **kw), 8, (2,)))
                    for i in range(rows)]  # fmt: skip
            sampler = Sampler(torch.device("cuda"), use_kernels=True)  # as the runner makes it on a GPU
            times = []
            for _ in range(25):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                sampler.sample_async(logits, reqs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            out[f"{name}@{rows}"] = round(sorted(times[5:])[10], 3)
    return out


def roofline(w: dict, arch) -> dict:
    """Dense FLOPs (2 x params x tokens, plus causal attention) over the bf16 peak; bytes of
    weights read once a decode step plus KV read, over the copy bandwidth."""
    params = arch.num_layers * (arch.hidden_size * (arch.q_size + 2 * arch.kv_size) + arch.q_size * arch.hidden_size
                                + 3 * arch.hidden_size * arch.intermediate_size) + arch.vocab_size * arch.hidden_size  # fmt: skip
    tokens = w["n"] * (w["inp"] + w["out"])
    attn = 4 * arch.num_layers * arch.num_heads * arch.head_dim * w["n"] * (w["inp"] + w["out"]) ** 2 / 2
    flops = 2 * params * tokens + attn
    steps = w["out"]  # decode steps, at least one per output token
    kv_per_token = 2 * arch.num_layers * arch.kv_size * 2
    bytes_ = steps * params * 2 + w["n"] * sum(kv_per_token * (w["inp"] + i) for i in range(w["out"]))
    return {"flop_bound_ms": round(flops / PEAK_TFLOPS / 1e9, 1), "byte_bound_ms": round(bytes_ / PEAK_TBPS / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--only", default="a,b,c")
    ap.add_argument("--engine", default="short", help="an engine of bench_rows.ENGINES (short, fp8, fp8kv, ...)")
    ap.add_argument("--no-sampler", action="store_true", help="skip the sampler's own timing")
    ap.add_argument("--step-log", action="store_true", help="the engine's step timing log: $OUT/steps_ENGINE.jsonl")
    opts = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from llmserve import LLM, SamplingParams
    from llmserve.bench.throughput import make_prompts
    from llmserve.cli_args import engine_args_from_cli

    make_model_folder()
    engine_args = vars(engine_args_from_cli(bench_args("throughput", ENGINES[opts.engine])))
    if opts.step_log:
        engine_args["step_timing_log"] = str(Path(opts.out, f"steps_{opts.engine}.jsonl").resolve())
    llm = LLM(**engine_args)
    arch = llm.config.model_config.arch
    results: dict = {"engine": opts.engine}
    if not opts.no_sampler:
        results["sampler_ms_per_step"] = sampler_ms(arch.vocab_size)
        print("RESULT sampler", json.dumps(results["sampler_ms_per_step"]), flush=True)
    for name in opts.only.split(","):
        w = WORKLOADS[name]
        prompts, outs = make_prompts(w["n"], w["inp"], w["out"], 0.0, arch.vocab_size, 1)
        params = [SamplingParams(temperature=w["temperature"], max_tokens=o, ignore_eos=True) for o in outs]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.reset_prefix_cache()
        before = torch.cuda.memory_stats()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        after = torch.cuda.memory_stats()
        allocator = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc",
                                                                      "num_device_free", "num_ooms")}  # fmt: skip
        results[name] = {**w, **breakdown(prof, wall), "roofline": roofline(w, arch), "allocator": allocator}
        print("RESULT", name, json.dumps(results[name]), flush=True)
        Path(opts.out, f"breakdown_{opts.engine}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
