"""`llmserve bench hf-baseline`: the `bench throughput` workload through Hugging Face
transformers `generate()`, the baseline the engine's throughput is read against.

Same requests as `bench throughput` with the same seed (random token ids, fixed input and
output lengths, EOS ignored through min_new_tokens = max_new_tokens), greedy, in static
batches of `--batch-size`: every row of a batch has the same length, so there is no
padding and the attention mask is all ones.
"""

from __future__ import annotations

import argparse
import sys
import time

from llmserve.bench.prompts import random_requests
from llmserve.bench.report import banner, row, write_json
from llmserve.config import TINY_MODEL_DIR

_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("hf-baseline", help="the throughput workload through transformers generate()")
    p.add_argument("--model", default=str(TINY_MODEL_DIR), help="Hugging Face model folder")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=128, help="static batch size")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16 or fp32")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights from config.json, built on the device",
    )
    p.add_argument("--attn-implementation", default=None, help="transformers attention (default: its own choice)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)


def resolve(device: str, dtype: str):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" else "fp32"
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return torch.device(device), getattr(torch, _DTYPES[dtype])


def load_model(model_dir: str, load_format: str, device, dtype, attn: str | None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {"attn_implementation": attn} if attn else {}
    if load_format != "dummy":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
        return model.to(device).eval()
    config = AutoConfig.from_pretrained(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init straight in the target dtype, on the device
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def run(args: argparse.Namespace) -> dict:
    import torch

    if min(args.num_prompts, args.input_len, args.output_len, args.batch_size) < 1:
        raise ValueError("--num-prompts, --input-len, --output-len and --batch-size must be >= 1")
    device, dtype = resolve(args.device, args.dtype)
    model = load_model(args.model, args.load_format, device, dtype, args.attn_implementation)
    cfg = model.config
    reqs = random_requests(args.num_prompts, args.input_len, args.output_len, cfg.vocab_size, args.bench_seed)
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos if eos is not None else 0)

    def generate(ids: list[list[int]], new_tokens: int) -> int:
        input_ids = torch.tensor(ids, device=device)
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
            pad_token_id=pad,
        )  # fmt: skip
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    ids = [r.prompt_token_ids for r in reqs]
    batches = [ids[i : i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    with torch.inference_mode():
        # warm-up: one whole batch, untimed. The first pass at full length pays for lazy kernel
        # loading, GEMM heuristics and the allocator growing with the KV cache; after a short
        # warm-up the first timed batch ran at half the speed of the next ones.
        t = time.perf_counter()
        generate(batches[0], args.output_len)
        _sync(device)
        _progress(f"warm-up batch ({_requests(len(batches[0]))}): {time.perf_counter() - t:.2f} s")
        batch_times, out_tokens = [], 0
        for i, batch in enumerate(batches):
            _sync(device)
            t = time.perf_counter()
            out_tokens += generate(batch, args.output_len)
            _sync(device)
            batch_times.append(time.perf_counter() - t)
            _progress(f"batch {i + 1}/{len(batches)} ({_requests(len(batch))}): {batch_times[-1]:.2f} s")
        elapsed = sum(batch_times)
    in_tokens = sum(r.prompt_len for r in reqs)
    result = {
        "model": args.model,
        "load_format": args.load_format,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "num_requests": len(reqs),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "batch_times_s": batch_times,
    }
    print(format_report(result))
    if args.output_json:
        write_json(args.output_json, result)
    return result


def _requests(n: int) -> str:
    return f"{n} request" + ("" if n == 1 else "s")


def _progress(line: str) -> None:
    """One line a batch on stderr: a baseline at 8B takes minutes."""
    print(f"[hf-baseline] {line}", file=sys.stderr, flush=True)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_report(r: dict) -> str:
    return "\n".join([
        banner("HF transformers Baseline Result"),
        row("Requests:", r["num_requests"]),
        row("Static batch size:", r["batch_size"]),
        row("Input / output length:", f"{r['input_len']} / {r['output_len']}"),
        row("Device / dtype:", f"{r['device']} / {r['dtype']}"),
        row("Elapsed (s):", r["elapsed_s"]),
        row("Request throughput (req/s):", r["requests_per_s"]),
        row("Output token throughput (tok/s):", r["output_tokens_per_s"]),
        row("Total token throughput (tok/s):", r["total_tokens_per_s"]),
        "=" * 50,
    ])  # fmt: skip
