"""`llmserve bench latency`: how long one batch takes, in-process, with the `LLM` engine.

Time to first token is measured on its own (runs with max_tokens=1); the time per output
token is (median whole run - median TTFT) / (output_len - 1). Every iteration gets fresh random
prompts, so the prefix cache cannot turn later iterations into cache hits. Next to the
per-token time it reports the weight bandwidth that time implies (each decode step reads
every weight once; of a mixture of experts only the experts its tokens pick), to read against
the hardware's memory bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import numpy as np

from llmserve.bench.gpu_monitor import monitor_for
from llmserve.bench.lora_args import BenchAdapters, add_lora_bench_args, enable_lora_for_bench
from llmserve.bench.prompts import random_requests
from llmserve.bench.report import banner, parse_percentiles, percentile_word, row, write_json
from llmserve.bench.sampling_args import add_sampling_args, sampling_label, sampling_params
from llmserve.cli_args import add_engine_args, engine_args_from_cli
from llmserve.heap import frozen
from llmserve.model.interface import count_expert_tokens, expert_token_counts


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("latency", help="latency of one batch: TTFT, time per output token, percentiles")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    p.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first")
    p.add_argument("--percentiles", default="50,90,99", help="of the whole-run latency")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--prompt-file", default=None,
                   help="every request's prompt is this file's text, as a chat's user message when the "
                   "tokenizer has a chat template (--input-len is then its length): a real workload, such "
                   "as a rewrite that repeats its input for speculative decoding; later iterations hit the "
                   "prefix cache unless --no-enable-prefix-caching")  # fmt: skip
    p.add_argument("--output-json", default=None)
    p.add_argument("--count-expert-tokens", action="store_true",
                   help="a mixture of experts: count the tokens each layer routes to each expert (load balance) "
                   "and report them (expert_tokens in the JSON); runs eager, since CUDA graphs captured "
                   "without the count would not count")  # fmt: skip
    add_sampling_args(p)
    add_lora_bench_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def weight_bytes_per_step(
    arch, dtype, quantization: str | None = None, quantization_ignore: tuple[str, ...] = (), batch_size: int = 1
) -> int:
    """Bytes of weights one decode step of `batch_size` sequences reads: every matrix once (one byte
    a weight in FP8, whose LM head and `quantization_ignore`'s projections stay in `dtype`); of a
    mixture of experts' layer (its family's `ExpertSpec`) the router, the shared expert and the
    experts the batch's tokens pick: `top_k` for one sequence, expected under uniform routing for
    more; the input embedding only for its few rows (so it counts only when tied to the LM head).
    Norms and scales are negligible."""
    from llmserve.model.fp8 import is_ignored
    from llmserve.model.registry import family_of

    family = family_of(arch)
    experts = family.experts(arch)
    fp8 = quantization == "fp8"
    total = 0.0
    for layer in range(arch.num_layers):
        for spec in family.linears(arch):
            if not spec.in_layer(layer):
                continue
            weights = spec.in_features * spec.out_features
            quantized = fp8 and spec.fp8 and not is_ignored(f"model.layers.{layer}.{spec.path}", quantization_ignore)
            total += weights * (1 if quantized else dtype.itemsize)
        moe = experts[layer] if layer < len(experts) else None
        if moe is not None:  # the router and shared expert stay 16-bit; the experts are FP8 when quantized
            expert_bytes = 1 if fp8 and moe.fp8 else dtype.itemsize
            total += moe.shared_weights * dtype.itemsize
            total += moe.experts_read(batch_size) * moe.expert_weights * expert_bytes
    return int(total) + arch.vocab_size * arch.hidden_size * dtype.itemsize  # + the LM head


def expert_load(counts: dict[int, list[int]] | None) -> dict | None:
    """Tokens per expert by layer, and how uneven: the busiest expert's count over the mean (1.0:
    perfectly balanced), per layer and the largest over the layers."""
    if not counts:
        return None
    imbalance = {layer: (max(c) * len(c) / sum(c) if sum(c) else None) for layer, c in counts.items()}
    worst = [v for v in imbalance.values() if v is not None]
    return {"per_layer": {str(k): v for k, v in counts.items()},
            "max_over_mean": {str(k): v for k, v in imbalance.items()},
            "worst_max_over_mean": max(worst) if worst else None}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    from llmserve import LLM

    parse_percentiles(args.percentiles)  # a bad list fails before the engine starts
    if min(args.batch_size, args.input_len, args.output_len, args.num_iters) < 1 or args.num_iters_warmup < 0:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1")
    enable_lora_for_bench(args)
    engine_args = engine_args_from_cli(args)
    if getattr(args, "count_expert_tokens", False):
        engine_args.enforce_eager = True
    return measure(LLM(**vars(engine_args)), args)


def measure(llm, args: argparse.Namespace) -> dict:
    """The timed runs `args` describe on a ready engine (also used by scripts that time
    several workloads on one engine)."""
    percentiles = parse_percentiles(args.percentiles)
    counting = getattr(args, "count_expert_tokens", False) and count_expert_tokens(llm.core.runner.model)
    monitor = monitor_for(llm)
    adapters = BenchAdapters(llm, args) if getattr(args, "lora_adapters", 0) else None
    try:
        with frozen("bench latency"), monitor or contextlib.nullcontext():  # no full GC pass mid-measurement
            result = _measure(args, llm, percentiles, adapters.for_requests(args.batch_size) if adapters else None)
    finally:
        if adapters is not None:
            adapters.close()
    result["lora"] = adapters.label(llm) if adapters else None
    result["expert_tokens"] = expert_load(expert_token_counts(llm.core.runner.model)) if counting else None
    usage = monitor.usage() if monitor is not None else None
    result["gpu"] = usage.as_dict() if usage is not None else None
    print(format_report(result))
    if usage is not None:
        print(usage.line())
    if args.output_json:
        write_json(args.output_json, result)
    return result


def _measure(args: argparse.Namespace, llm, percentiles: list[float], loras=None) -> dict:
    mc = llm.config.model_config
    rng = random.Random(args.bench_seed)
    fixed = file_prompt(llm, args.prompt_file) if getattr(args, "prompt_file", None) else None
    if fixed is not None:
        args.input_len = len(fixed)

    def timed(max_tokens: int) -> float:
        if fixed is not None:
            prompts = [fixed] * args.batch_size
        else:
            reqs = random_requests(args.batch_size, args.input_len, 1, mc.arch.vocab_size, rng.getrandbits(63))
            prompts = [r.prompt_token_ids for r in reqs]
        params = [sampling_params(args, max_tokens, i) for i in range(len(prompts))]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        timed(args.output_len)
    ttfts = [timed(1) for _ in range(args.num_iters)]
    before = llm.stats()
    latencies = [timed(args.output_len) for _ in range(args.num_iters)]
    spec = spec_decode_summary(before, llm.stats())

    # per output token from medians: one stalled run (a GC pass, a late compile) must not
    # move the TTFT it is subtracted from (a mean of the TTFTs did)
    ttft, avg = float(np.median(ttfts)), float(np.mean(latencies))
    tpot = (float(np.median(latencies)) - ttft) / (args.output_len - 1) if args.output_len > 1 else None
    wbytes = weight_bytes_per_step(mc.arch, mc.dtype, mc.quantization, mc.quantization_ignore, args.batch_size)
    result = {
        "model": mc.model,
        "device": llm.config.device,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "quantization": mc.quantization,
        "quantization_ignore": list(mc.quantization_ignore),
        "kv_cache_dtype": getattr(llm.config.cache_config, "kv_cache_dtype", "auto"),
        "kv_cache_tokens": llm.stats().kv_cache_tokens,
        "kv_scales": llm.core.runner.kv_scales.label(),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "ttft_ms": ttft * 1000,  # median
        "mean_ttft_ms": float(np.mean(ttfts)) * 1000,
        "ttfts": ttfts,
        "tpot_ms": None if tpot is None else tpot * 1000,
        "output_tokens_per_s_per_seq": None if not tpot else 1.0 / tpot,
        "weight_bytes_per_step": wbytes,
        "weight_bandwidth_gb_s": None if not tpot else wbytes / tpot / 1e9,
        "avg_latency": avg,
        "latencies": latencies,
        "percentiles": {percentile_word(p): float(np.percentile(latencies, p)) for p in percentiles},
        "sampling": sampling_label(args) or None,
        "prompt_file": getattr(args, "prompt_file", None),
        "spec_decode": spec,
    }
    return result


def file_prompt(llm, path: str) -> list[int]:
    """The prompt ids of a text file: a user message through the chat template, if the tokenizer
    has one, else the text."""
    from pathlib import Path

    text = Path(path).read_text()
    tokenizer = llm.get_tokenizer()
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def spec_decode_summary(before, after) -> dict | None:
    """Speculative decoding over the timed runs: proposals, acceptances, the acceptance rate and
    the mean tokens a speculating step makes (1 + accepted per verification)."""
    drafts = after.spec_num_drafts - before.spec_num_drafts
    if drafts <= 0:
        return None
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_position = [a - b for a, b in zip(after.spec_accepted_per_position, before.spec_accepted_per_position)]
    return {"verifications": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts, "accepted_per_position": per_position}  # fmt: skip


def format_report(r: dict) -> str:
    lines = [
        banner("Latency Benchmark Result"),
        row("Batch size:", r["batch_size"]),
        row("Input / output length:", f"{r['input_len']} / {r['output_len']}"),
        row("Iterations:", r["num_iters"]),
        *(
            [
                row(
                    "LoRA adapters (rank, slots):",
                    f"{r['lora']['adapters']} ({r['lora']['rank']}, {r['lora']['max_loras']})",
                )
            ]
            if r.get("lora")
            else []
        ),
        row("Median TTFT (ms):", r["ttft_ms"]),
        row("Mean TTFT (ms):", r["mean_ttft_ms"]),
    ]
    if r.get("expert_tokens"):
        lines.append(row("Expert load (busiest / mean):", r["expert_tokens"]["worst_max_over_mean"]))
    if r["tpot_ms"] is not None:
        lines += [
            row("Time per output token (ms):", r["tpot_ms"]),
            row("Output tokens/s per sequence:", r["output_tokens_per_s_per_seq"]),
            row("Weight read bandwidth (GB/s):", r["weight_bandwidth_gb_s"]),
        ]
    if r.get("spec_decode"):
        spec = r["spec_decode"]
        lines += [
            row("Speculative acceptance rate:", spec["acceptance_rate"]),
            row("Mean acceptance length:", spec["mean_acceptance_length"]),
        ]
    # the JSON keeps vLLM's seconds; the table shows ms, readable at small sizes
    lines.append(row("Avg latency (ms):", r["avg_latency"] * 1000))
    lines += [row(f"P{p} latency (ms):", v * 1000) for p, v in r["percentiles"].items()]
    lines.append("=" * 50)
    return "\n".join(lines)
