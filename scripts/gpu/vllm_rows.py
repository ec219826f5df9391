"""vLLM 0.25 on bench_rows.py's rows: the same prompts, lengths, sampling and engine budgets, through
vLLM's offline `LLM.generate`, measured the way `llmserve bench throughput` / `latency` measure (a
warm-up request, then the timed batch; TTFT from runs of one token, the time per output token from
the medians). Run it with vLLM on the path (../shared/vllm/README.md) after `bench_rows.py` made the
model folders (`--folders-only`); it imports nothing of llmserve but the torch-free prompt maker.

    PYTHONPATH=/root/vllm_site:$PWD python3 scripts/gpu/vllm_rows.py --out $OUT --only a_moe,b_moe,c_moe
    python3 scripts/gpu/vllm_rows.py --compare $OUT/rows.json $OUT/vllm_rows.json   # the ratio table

Engines map flag by flag (model, dummy weights, lengths and budgets, `--quantization fp8`, the FP8 KV
cache); `int8` runs a compressed-tensors W8A8-int8 folder (weights per channel, activations per token,
dynamic: the scheme of `--quantization int8`), `gptq` the GPTQ folder (vLLM picks GPTQ-Marlin). Any other
flag stops the script rather than run a different engine under the same name.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llmserve.bench.prompts import random_requests  # noqa: E402  (stdlib only)

INT8_CT = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                              "dynamic": False},
                                  "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                        "strategy": "token", "dynamic": True}}},
}  # fmt: skip
INT8_FOLDER = "/tmp/llama8b_w8a8_ct"
ENGINE_FLAGS = {"--model": "model", "--load-format": "load_format", "--max-model-len": "max_model_len",
                "--max-num-seqs": "max_num_seqs", "--max-num-batched-tokens": "max_num_batched_tokens",
                "--quantization": "quantization", "--kv-cache-dtype": "kv_cache_dtype"}  # fmt: skip


def engine_kwargs(name: str, flags: list[str]) -> dict:
    kwargs = {"gpu_memory_utilization": 0.9, "seed": 0, "disable_log_stats": True}
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag not in ENGINE_FLAGS:
            raise SystemExit(f"engine {name}: {flag} has no vLLM counterpart here")
        kwargs[ENGINE_FLAGS[flag]] = int(value) if value.isdigit() else value
    if kwargs.get("quantization") == "int8":  # vLLM's int8 is a checkpoint's scheme: a compressed-tensors folder
        from bench_rows import quantized_copy

        if not Path(INT8_FOLDER, "config.json").is_file():
            quantized_copy(kwargs["model"], INT8_FOLDER, INT8_CT)
        kwargs.update(model=INT8_FOLDER, quantization=None)
    return kwargs


def row_args(flags: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name, default in (("num-prompts", 100), ("input-len", 128), ("output-len", 128), ("prefix-len", 0),
                          ("bench-seed", 0), ("batch-size", 1), ("num-iters", 30), ("num-iters-warmup", 10), ("n", 1),
                          ("top-k", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("range-ratio", 0.0), ("temperature", 1.0), ("top-p", 1.0), ("min-p", 0.0),
                          ("presence-penalty", 0.0), ("frequency-penalty", 0.0), ("repetition-penalty", 1.0)):  # fmt: skip
        p.add_argument(f"--{name}", type=float, default=default)
    return p.parse_args(flags)  # an unknown flag (a sampling mix, logprobs, LoRA) stops the script


def sampling(args: argparse.Namespace, max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k if args.top_k > 0 else -1, min_p=args.min_p, n=args.n,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty)  # fmt: skip


def throughput(llm, args: argparse.Namespace, vocab: int) -> dict:
    reqs = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.bench_seed, args.range_ratio)
    prefix = (
        random_requests(1, args.prefix_len, 1, vocab, args.bench_seed + 1)[0].prompt_token_ids
        if args.prefix_len
        else []
    )
    prompts = [{"prompt_token_ids": prefix + r.prompt_token_ids} for r in reqs]
    params = [sampling(args, r.output_len) for r in reqs]
    from vllm import SamplingParams

    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"elapsed_s": round(elapsed, 3), "output_tokens_per_s": round(out_tokens / elapsed, 1),
            "output_tokens": out_tokens}  # fmt: skip


def latency(llm, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(args.bench_seed)

    def timed(max_tokens: int) -> float:
        reqs = random_requests(args.batch_size, args.input_len, 1, vocab, rng.getrandbits(63))
        start = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": r.prompt_token_ids} for r in reqs], sampling(args, max_tokens), use_tqdm=False
        )
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        timed(args.output_len)
    ttfts = [timed(1) for _ in range(args.num_iters)]
    latencies = [timed(args.output_len) for _ in range(args.num_iters)]
    ttft = statistics.median(ttfts)
    tpot = (statistics.median(latencies) - ttft) / (args.output_len - 1)
    return {"ttft_ms": round(ttft * 1e3, 2), "tpot_ms": round(tpot * 1e3, 3)}


def compare(ours_path: str, theirs_path: str) -> str:
    """A markdown table: each row both engines ran, with llmserve / vLLM (throughput) or vLLM / llmserve (times)."""
    ours, theirs = json.loads(Path(ours_path).read_text()), json.loads(Path(theirs_path).read_text())
    lines = ["| row | llmserve | vLLM 0.25 | ratio |", "| --- | ---: | ---: | ---: |"]
    for name, mine in ours.items():
        other = theirs.get(name)
        if not isinstance(other, dict) or not isinstance(mine, dict):
            continue
        if "output_tokens_per_s" in mine and "output_tokens_per_s" in other:
            a, b = mine["output_tokens_per_s"], other["output_tokens_per_s"]
            lines.append(f"| {name} (output tok/s) | {a:,.0f} | {b:,.0f} | {a / b:.3f} |")
        elif mine.get("tpot_ms") and other.get("tpot_ms"):
            a, b = mine["tpot_ms"], other["tpot_ms"]
            lines.append(f"| {name} ms/token (TTFT ms) | {a:.3f} ({mine.get('ttft_ms', 0):.1f}) | "
                         f"{b:.3f} ({other['ttft_ms']:.1f}) | {b / a:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--only", default="", help="comma-separated row names of bench_rows.py")
    parser.add_argument("--compare", nargs=2, metavar=("OURS_JSON", "VLLM_JSON"))
    opts = parser.parse_args()
    if opts.compare:
        print(compare(*opts.compare))
        return
    from bench_rows import ENGINES, ROWS  # (torch only)

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    names = opts.only.split(",") if opts.only else list(ROWS)
    engines = list(dict.fromkeys(ROWS[n][0] for n in names))
    if len(engines) > 1:  # one process per engine: each vLLM engine's memory goes with its process
        import subprocess

        for engine in engines:
            rows = ",".join(n for n in names if ROWS[n][0] == engine)
            subprocess.run([sys.executable, __file__, "--out", str(out), "--only", rows], check=False)
        return
    results: dict = {}
    path = out / "vllm_rows.json"
    if path.is_file():
        results = json.loads(path.read_text())
    import vllm

    for engine in engines:
        kwargs = engine_kwargs(engine, ENGINES[engine])
        started = time.perf_counter()
        llm = vllm.LLM(**kwargs)
        startup = time.perf_counter() - started
        vocab = json.loads(Path(kwargs["model"], "config.json").read_text())["vocab_size"]
        print(f"RESULT vllm engine {engine} ready in {startup:.1f} s ({kwargs})", flush=True)
        for name in (n for n in names if ROWS[n][0] == engine):
            _, command, flags = ROWS[name]
            args = row_args(flags)
            t0 = time.perf_counter()
            record = throughput(llm, args, vocab) if command == "throughput" else latency(llm, args, vocab)
            results[name] = {"engine": kwargs, "command": f"vllm {command} {shlex.join(flags)}",
                             "wall_s": round(time.perf_counter() - t0, 1), "startup_s": round(startup, 1),
                             "vllm": vllm.__version__, **record}  # fmt: skip
            print("RESULT vllm", name, json.dumps(record), flush=True)
            path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
