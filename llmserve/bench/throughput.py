"""`llmserve bench throughput`: offline throughput of the engine on a fixed workload.

N requests of random prompt token ids, fixed (or uniformly ranged) input and output
lengths, ignore_eos, all submitted at once, as `vllm bench throughput` does; optionally a
prefix of `--prefix-len` tokens shared by every prompt (before each one's own tokens), and
any sampling settings (`--temperature 0` is greedy; penalties, top-k/p, min-p, n, logprobs).
On a GPU the report adds its utilisation and memory over the run (NVML).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict, dataclass

from llmserve.bench.gpu_monitor import monitor_for
from llmserve.bench.lora_args import BenchAdapters, add_lora_bench_args, enable_lora_for_bench
from llmserve.bench.prompts import random_requests
from llmserve.bench.sampling_args import add_sampling_args, sampling_label, sampling_params
from llmserve.cli_args import add_engine_args, engine_args_from_cli
from llmserve.engine.pp_batches import busy_line
from llmserve.heap import frozen


@dataclass
class ThroughputResult:
    num_requests: int
    input_len: int
    output_len: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    num_preemptions: int
    max_num_seqs: int
    startup_s: float  # from the command's start to a ready engine (weights, KV cache, graphs)
    prefix_len: int = 0
    quantization: str | None = None  # the engine's (fp8), and its KV cache's dtype
    kv_cache_dtype: str = "auto"
    quantization_ignore: list[str] | None = None  # projections kept unquantized (--quantization-ignore)
    kv_cache_tokens: int = 0  # tokens the engine's KV cache holds
    kv_scales: str | None = None  # an FP8 KV cache's scales: where from, and their range
    sampling: dict | None = None  # the settings that differ from the defaults
    gpu: dict | None = None  # utilisation and memory over the timed run (gpu_monitor.GpuUsage)
    lora: dict | None = None  # the adapters the requests took in turn (--lora-adapters)
    # pipeline parallelism: batches in the stages at once, and each rank's share of the timed run
    # spent in its stage's layers ({"stage": s, "tp_rank": t, "busy": fraction}; the bubble is the rest)
    pp_batches_in_flight: int | None = None
    pp_stage_busy: list[dict] | None = None


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput: N requests at once")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares, before its own")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--output-json", default=None)
    add_sampling_args(p)
    add_lora_bench_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def make_prompts(n: int, input_len: int, output_len: int, ratio: float, vocab: int, seed: int, prefix_len: int = 0):
    """Engine prompts and their output lengths (the same requests `bench hf-baseline` sends);
    with `prefix_len`, one random prefix of that many tokens starts every prompt."""
    reqs = random_requests(n, input_len, output_len, vocab, seed, ratio)
    prefix = random_requests(1, prefix_len, 1, vocab, seed + 1)[0].prompt_token_ids if prefix_len > 0 else []
    return [{"prompt_token_ids": prefix + r.prompt_token_ids} for r in reqs], [r.output_len for r in reqs]


def run(args: argparse.Namespace) -> ThroughputResult:
    from llmserve import LLM

    enable_lora_for_bench(args)
    engine_args = engine_args_from_cli(args)
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    return measure(llm, args, time.perf_counter() - t0)


def measure(llm, args: argparse.Namespace, startup: float = 0.0) -> ThroughputResult:
    """One timed run of the workload `args` describes on a ready engine (also used by scripts
    that time several workloads on one engine)."""
    from llmserve import SamplingParams

    if args.prefix_len < 0:
        raise ValueError("--prefix-len must be >= 0")
    vocab = llm.config.model_config.arch.vocab_size
    prompts, out_lens = make_prompts(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, args.bench_seed, args.prefix_len
    )
    params = [sampling_params(args, n, i) for i, n in enumerate(out_lens)]
    adapters = BenchAdapters(llm, args) if getattr(args, "lora_adapters", 0) else None
    loras = adapters.for_requests(len(prompts)) if adapters else None
    try:
        # warm-up (with the first adapter: its read and first load are not timed either)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                     lora_request=loras[:1] if loras else None)  # fmt: skip
        monitor = monitor_for(llm)
        staged = llm.config.pipeline_parallel_size > 1
        if staged:
            llm.core.stage_busy(reset=True)  # (the warm-up's and the start's forwards not counted)
        with frozen("bench throughput"), monitor or contextlib.nullcontext():  # no full GC pass mid-measurement
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=loras)
            elapsed = time.perf_counter() - start
    finally:
        if adapters is not None:
            adapters.close()
    usage = monitor.usage() if monitor is not None else None
    busy = llm.core.stage_busy() if staged else None
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    result = ThroughputResult(
        num_requests=len(prompts),
        input_len=args.input_len,
        output_len=args.output_len,
        elapsed_s=round(elapsed, 3),
        requests_per_s=round(len(prompts) / elapsed, 3),
        output_tokens_per_s=round(out_tokens / elapsed, 1),
        total_tokens_per_s=round((in_tokens + out_tokens) / elapsed, 1),
        num_preemptions=llm.stats().num_preemptions,
        max_num_seqs=llm.config.scheduler_config.max_num_seqs,
        startup_s=round(startup, 1),
        prefix_len=args.prefix_len,
        quantization=llm.config.model_config.quantization,
        quantization_ignore=list(llm.config.model_config.quantization_ignore) or None,
        kv_cache_dtype=getattr(llm.config.cache_config, "kv_cache_dtype", "auto"),
        kv_cache_tokens=llm.stats().kv_cache_tokens,
        kv_scales=llm.core.runner.kv_scales.label(),
        sampling=sampling_label(args) or None,
        gpu=usage.as_dict() if usage is not None else None,
        lora=adapters.label(llm) if adapters else None,
        pp_batches_in_flight=llm.config.pipeline_batches_in_flight if staged else None,
        pp_stage_busy=[{"stage": b.stage, "tp_rank": b.tp_rank, "busy": round(b.fraction, 3)} for b in busy]
        if busy
        else None,
    )
    print(
        f"Throughput: {result.requests_per_s:.2f} requests/s, "
        f"{result.total_tokens_per_s:.1f} total tokens/s, "
        f"{result.output_tokens_per_s:.1f} output tokens/s "
        f"({result.num_requests} requests, {in_tokens} prompt + {out_tokens} output tokens in {elapsed:.2f} s; "
        f"engine ready in {startup:.1f} s)"
        + (
            f"; {result.lora['adapters']} LoRA adapters of rank {result.lora['rank']} in turn, "
            f"{result.lora['max_loras']} device slots"
            if result.lora
            else ""
        )
    )
    if usage is not None:
        print(usage.line())
    if busy:
        print(f"{busy_line(busy)}, {result.pp_batches_in_flight} batch(es) in flight")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return result
