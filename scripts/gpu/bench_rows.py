"""The workload rows of the sampling/long-prompt issue, timed on the H200 in one process.

Each row is exactly a `llmserve bench throughput` or `llmserve bench latency` command line
(ROWS below, printed with its result); they run on shared engines so that the device
call pays two start-ups, not one per row:
- engine "short": the 8B shape, dummy weights, bf16, max_model_len 2048, vLLM's offline
  budgets (1024 sequences, 16,384 batched tokens);
- engine "long": the same with max_model_len 33,024 (prompts of 7,680 to 32,768 tokens).
First, on the GPU, the batched sampler is checked against the reference sampler (seeded
rows, penalties, top-k/top-p, logprobs over 128,256 tokens); rows named "...@reference"
swap the reference sampler into the running engine (penalties then run one step at a
time, as before the batched sampler).

    python3 scripts/gpu/bench_rows.py --out $OUT [--only a,presence,...] [--root DIR]

`--root DIR` imports llmserve from DIR (a `git archive REV llmserve` unpacked there) for a
before/after of two trees in one lease (scripts/gpu/ab_trees.sh); `--no-sampler-check` skips
the sampler check.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODEL = "/tmp/llama8b"
MODEL_70B = "/tmp/llama70b"
MODEL_QWEN3MOE = "/tmp/qwen3_30b_a3b"  # Qwen3-30B-A3B's shape: 48 layers, 128 experts, top-8 (issue 52)
MODEL_GEMMA3 = "/tmp/gemma3_270m"  # Gemma 3 270M's shape (sliding window 512 on five of six layers)
ENGINES = {
    "short": ["--model", MODEL, "--load-format", "dummy", "--max-model-len", "2048",
              "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384"],
    "long": ["--model", MODEL, "--load-format", "dummy", "--max-model-len", "33024",
             "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384"],
}  # fmt: skip
ENGINES["fp8"] = ENGINES["short"] + ["--quantization", "fp8"]
ENGINES["fp8kv"] = ENGINES["fp8"] + ["--kv-cache-dtype", "fp8"]
ENGINES["70b_fp8"] = ["--model", MODEL_70B, "--load-format", "dummy", "--quantization", "fp8", "--max-model-len", "2048",
                      "--max-num-seqs", "256", "--max-num-batched-tokens", "16384"]  # fmt: skip
A = ["--num-prompts", "512", "--input-len", "512", "--output-len", "256"]
ENGINES["gemma3"] = ["--model", MODEL_GEMMA3, "--load-format", "dummy", "--max-model-len", "4096",
                     "--max-num-seqs", "256", "--max-num-batched-tokens", "16384"]  # fmt: skip
# name: (engine, bench command, flags)
ROWS = {
    "a": ("short", "throughput", A + ["--temperature", "0"]),
    "a_t1": ("short", "throughput", A),  # temperature 1.0: the default calls' (a)
    "topp": ("short", "throughput", A + ["--temperature", "0.8", "--top-p", "0.95", "--top-k", "50"]),
    "presence": ("short", "throughput", A + ["--temperature", "0.8", "--presence-penalty", "0.5"]),
    "repetition": ("short", "throughput", A + ["--temperature", "0", "--repetition-penalty", "1.1"]),
    # more of the same kinds, not in the table: each against (a) by the same 5 % rule
    "topp_only": ("short", "throughput", A + ["--temperature", "0.8", "--top-p", "0.95"]),
    "frequency": ("short", "throughput", A + ["--temperature", "0.8", "--frequency-penalty", "0.5"]),
    "minp": ("short", "throughput", A + ["--temperature", "0.8", "--min-p", "0.05"]),
    "seeded": ("short", "throughput", A + ["--temperature", "0.8", "--top-p", "0.95", "--sampling-seed", "7"]),
    "openai": ("short", "throughput", A + ["--temperature", "0.7", "--top-p", "0.9", "--presence-penalty", "0.3",
                                           "--frequency-penalty", "0.3"]),
    "logprobs": ("short", "throughput", A + ["--temperature", "0", "--logprobs", "5"]),
    # a server's traffic: five kinds of request in turn in one batch (greedy, the OpenAI client's
    # mix, a chat front-end's top-k/top-p with repetition penalty, seeded top-p, greedy with logprobs)
    "mixed": ("short", "throughput", A + ["--sampling-mix", json.dumps([
        {"temperature": 0}, {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.3, "frequency_penalty": 0.3},
        {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "repetition_penalty": 1.1},
        {"temperature": 1.0, "top_p": 0.95, "sampling_seed": 7}, {"temperature": 0, "logprobs": 5}])]),
    "n4": ("short", "throughput", ["--num-prompts", "128", "--input-len", "512", "--output-len", "256",
                                   "--temperature", "0.8", "--n", "4"]),
    "presence@reference": ("short", "throughput", A + ["--temperature", "0.8", "--presence-penalty", "0.5"]),
    "repetition@reference": ("short", "throughput", A + ["--temperature", "0", "--repetition-penalty", "1.1"]),
    "prefix": ("short", "throughput", ["--num-prompts", "1024", "--prefix-len", "1024", "--input-len", "128",
                                       "--output-len", "128", "--temperature", "0"]),
    "c": ("short", "throughput", ["--num-prompts", "1000", "--input-len", "1024", "--output-len", "128"]),
    "long64": ("long", "throughput", ["--num-prompts", "64", "--input-len", "7680", "--output-len", "256",
                                      "--temperature", "0"]),
    "b": ("short", "latency", ["--batch-size", "1", "--input-len", "512", "--output-len", "256", "--num-iters", "5",
                               "--num-iters-warmup", "2"]),
    "ttft7680": ("long", "latency", ["--batch-size", "1", "--input-len", "7680", "--output-len", "256",
                                     "--num-iters", "5", "--num-iters-warmup", "2"]),
    "ttft16k": ("long", "latency", ["--batch-size", "1", "--input-len", "16384", "--output-len", "2",
                                    "--num-iters", "3", "--num-iters-warmup", "1"]),
    "ttft32k": ("long", "latency", ["--batch-size", "1", "--input-len", "32768", "--output-len", "2",
                                    "--num-iters", "3", "--num-iters-warmup", "1"]),
}  # fmt: skip
# FP8 (weights and activations; then the KV cache too), and a 70B shape in FP8 on one GPU
for _engine in ("fp8", "fp8kv"):
    ROWS[f"a_{_engine}"] = (_engine, "throughput", A + ["--temperature", "0"])
    ROWS[f"c_{_engine}"] = (_engine, "throughput", ROWS["c"][2])
ROWS["b_fp8"] = ("fp8", "latency", ROWS["b"][2])
# the last layer's down_proj kept in bf16 (SmolLM2: +2.18 % -> +1.07-1.14 % perplexity): its cost on the 8B
# shape, to decide whether FP8 keeps it by default; and the FP8 KV cache with scale 1 against calibrated
ENGINES["fp8keep"] = ENGINES["fp8"] + ["--quantization-ignore", "model.layers.31.mlp.down_proj"]
ENGINES["fp8kv1"] = ENGINES["fp8kv"] + ["--no-calculate-kv-scales"]
for _row, _base in (("a", "a_fp8"), ("b", "b_fp8"), ("c", "c_fp8")):
    ROWS[f"{_row}_fp8keep"] = ("fp8keep", ROWS[_base][1], ROWS[_base][2])
ROWS["a_fp8kv1"] = ("fp8kv1", "throughput", ROWS["a_fp8kv"][2])
# FP8 GEMMs with the exact accumulation at every size (the default accumulates fast from 1,024 tokens
# on), and admissions that keep no blocks for the running requests' growth (the default keeps 256
# tokens' worth each): each before-and-after of 2026-12-02 (session 5)
ENGINES["fp8exact"] = ENGINES["fp8"] + ["--fp8-fast-accum-tokens", "0"]
ENGINES["fp8res0"] = ENGINES["fp8"] + ["--admission-reserve-tokens", "0"]
ENGINES["res0"] = ENGINES["short"] + ["--admission-reserve-tokens", "0"]
for _row in ("a", "c"):
    ROWS[f"{_row}_fp8exact"] = ("fp8exact", "throughput", ROWS[f"{_row}_fp8"][2])
ROWS["c_fp8res0"] = ("fp8res0", "throughput", ROWS["c_fp8"][2])
ROWS["c_res0"] = ("res0", "throughput", ROWS["c"][2])
ROWS["a_70b_fp8"] = ("70b_fp8", "throughput", ["--num-prompts", "256", "--input-len", "512", "--output-len", "256",
                                               "--temperature", "0"])  # fmt: skip
ROWS["b_70b_fp8"] = ("70b_fp8", "latency", ROWS["b"][2])
# Multi-LoRA (issue 22): rank-16 adapters on q, k, v, o, gate, up, down, taken by the requests in
# turn, under CUDA graphs; 8 adapters in 8 slots, then 64 adapters sharing 16 slots (swaps)
LORA = ["--enable-lora", "--max-lora-rank", "16", "--lora-cuda-graphs"]
ENGINES["lora8"] = ENGINES["short"] + LORA + ["--max-loras", "8"]
ENGINES["lora64"] = ENGINES["short"] + LORA + ["--max-loras", "16", "--max-cpu-loras", "64"]
ROWS["a_lora8"] = ("lora8", "throughput", ROWS["a"][2] + ["--lora-adapters", "8", "--lora-rank", "16"])
ROWS["b_lora"] = ("lora8", "latency", ROWS["b"][2] + ["--lora-adapters", "1", "--lora-rank", "16"])
ROWS["a_lora64"] = ("lora64", "throughput", ROWS["a"][2] + ["--lora-adapters", "64", "--lora-rank", "16"])
# the expand of steps of 65+ tokens as one cuBLAS GEMM a slice in gate/up (llmserve/lora/expand_gemm.py):
# the default since 2026-12-01 (lora8 = lora8g); lora8t: the Triton expand everywhere, as before
ENGINES["lora8g"] = ENGINES["lora8"] + ["--lora-expand-gemm-tokens", "65"]
ENGINES["lora8t"] = ENGINES["lora8"] + ["--lora-expand-gemm-tokens", "0"]  # the Triton expand in every step
ROWS["a_lora8g"] = ("lora8g", "throughput", ROWS["a_lora8"][2])
ROWS["a_lora8t"] = ("lora8t", "throughput", ROWS["a_lora8"][2])
# the adapter of steps of one token on a second stream beside the base GEMM (llmserve/lora/apply.py):
# the default since 2026-12-02; lora8s: in order on one stream, as before
ENGINES["lora8s"] = ENGINES["lora8"] + ["--lora-overlap-tokens", "0"]
ROWS["b_lora_seq"] = ("lora8s", "latency", ROWS["b_lora"][2])
# Gemma 3 (issue 50): decode at 256 concurrent requests, beside the Llama 8B shape's; prompts past the window
DECODE256 = ["--num-prompts", "256", "--input-len", "128", "--output-len", "512", "--temperature", "0"]
ROWS["decode256"] = ("short", "throughput", DECODE256)
ROWS["gemma3_decode256"] = ("gemma3", "throughput", DECODE256)
ROWS["gemma3_long"] = ("gemma3", "throughput", ["--num-prompts", "256", "--input-len", "1536", "--output-len", "256",
                                                "--temperature", "0"])  # fmt: skip
ROWS["gemma3_b"] = ("gemma3", "latency", ROWS["b"][2])
# W8A8 INT8 and 4-bit GPTQ (issue 57): the 8B shape; GPTQ group 128, symmetric, no act-order (a config-only
# folder beside the 8B one: the checkpoint's format, dummy 4-bit weights)
MODEL_GPTQ = "/tmp/llama8b_gptq"
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
ENGINES["int8"] = ENGINES["short"] + ["--quantization", "int8"]
ENGINES["gptq"] = ["--model", MODEL_GPTQ] + ENGINES["short"][2:]
for _engine in ("int8", "gptq"):
    for _row in ("a", "b", "c"):
        ROWS[f"{_row}_{_engine}"] = (_engine, ROWS[_row][1], ROWS[_row][2])
# mixtures of experts (issue 52): the Qwen3-30B-A3B shape, bf16 and FP8, the (a)/(b)/(c) workloads
ENGINES["moe"] = ["--model", MODEL_QWEN3MOE] + ENGINES["short"][2:]
ENGINES["moe_fp8"] = ENGINES["moe"] + ["--quantization", "fp8"]
for _engine in ("moe", "moe_fp8"):
    for _row in ("a", "b", "c"):
        ROWS[f"{_row}_{_engine}"] = (_engine, ROWS[_row][1], ROWS[_row][2])


def bench_args(command: str, flags: list[str]) -> argparse.Namespace:
    from llmserve.bench import latency, throughput

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="bench_command")
    (throughput if command == "throughput" else latency).add_parser(sub)
    return parser.parse_args([command, *flags])


def check_sampler_on_gpu() -> dict:
    """Batched sampler == reference sampler on the GPU, 64 rows x 128,256 tokens, 12 steps:
    a mixed batch (the full-sort path) and a batch whose random rows all have a top-k (the
    top-k path). Every random row is seeded, so every row must match."""
    from llmserve.engine.request import EngineCoreRequest, Request
    from llmserve.engine.sampler import Sampler
    from llmserve.engine.sampler_reference import ReferenceSampler
    from llmserve.sampling_params import SamplingParams

    device = torch.device("cuda")
    mixed = [dict(temperature=0), dict(temperature=0, repetition_penalty=1.2),
             dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.2), dict(temperature=0.8, top_k=50, top_p=0.95),
             dict(temperature=1.0, min_p=0.05, logit_bias={11: 5.0}), dict(temperature=0.7, top_p=0.9, logprobs=3)]  # fmt: skip
    top_k = [dict(temperature=0), dict(temperature=0.8, top_k=50, top_p=0.95, presence_penalty=0.5),
             dict(temperature=1.0, top_k=5), dict(temperature=0.6, top_k=1000, min_p=0.02, repetition_penalty=1.1),
             dict(temperature=0.9, top_k=40, logprobs=2), dict(temperature=0, frequency_penalty=0.3)]  # fmt: skip

    def run(sampler_cls, kinds) -> tuple[list[list[int]], list]:
        gen = torch.Generator(device=device).manual_seed(0)
        reqs = [Request(EngineCoreRequest(f"r{i}", list(range(10 + i, 200 + i)), SamplingParams(
            max_tokens=50, seed=i if kinds[i % 6].get("temperature") else None, **kinds[i % 6]), 50, (2,)))
            for i in range(64)]  # fmt: skip
        sampler, out, lps = (
            (sampler_cls(device, use_kernels=True) if sampler_cls is Sampler else sampler_cls(device)),
            [],
            [],
        )
        for _ in range(12):
            logits = torch.randn(64, 128256, device=device, generator=gen) * 3
            step = sampler(logits, reqs)
            out.append(step.token_ids)
            lps.extend(lp for lp in step.logprobs or [] if lp is not None)
            for r, t in zip(reqs, step.token_ids):
                r.all_token_ids.append(t)
        return out, lps

    def same_logprobs(a, b) -> bool:  # rank and top ids equal, values to float32 rounding (another sum order)
        return (a.token_rank == b.token_rank and [i for i, _ in a.top] == [i for i, _ in b.top]
                and all(abs(x - y) <= 1e-4 for x, y in zip([a.token_logprob] + [v for _, v in a.top],
                                                           [b.token_logprob] + [v for _, v in b.top])))  # fmt: skip

    result = {}
    for name, kinds in (("mixed", mixed), ("top_k", top_k)):
        (batched, lp_b), (reference, lp_r) = run(Sampler, kinds), run(ReferenceSampler, kinds)
        same = sum(a == b for step_a, step_b in zip(batched, reference) for a, b in zip(step_a, step_b))
        result[name] = f"{same} of {64 * 12} equal"
        result[name + "_logprobs"] = (
            f"{sum(map(same_logprobs, lp_b, lp_r))} of {len(lp_r)} equal" if len(lp_b) == len(lp_r) else "rows differ"
        )
    return result


def make_model_folder(names: list[str]) -> None:
    """The Llama-3.1-8B and -70B shapes (and Gemma 3 270M's where a row asks), config and tokenizer only
    (weights: --load-format dummy). Gemma's only on demand: a tree older than the Gemma 3 family is timed too."""
    from llmserve.model.random_model import make_random_model

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    if any(ROWS[n][0].startswith("gemma3") for n in names) and not Path(MODEL_GEMMA3, "config.json").is_file():
        make_random_model(MODEL_GEMMA3, "gemma3", vocab_size=262144, config_only=True, hidden_size=640,
                          intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                          head_dim=256, query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
                          rope_theta=1000000.0)  # fmt: skip
    if any(ROWS[n][0].startswith("moe") for n in names) and not Path(MODEL_QWEN3MOE, "config.json").is_file():
        make_random_model(MODEL_QWEN3MOE, "qwen3_moe", vocab_size=151936, config_only=True, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False)  # fmt: skip
    for path, hidden, inter, layers, heads in ((MODEL, 4096, 14336, 32, 32), (MODEL_70B, 8192, 28672, 80, 64)):
        if not Path(path, "config.json").is_file():
            make_random_model(path, "llama", vocab_size=128256, config_only=True, hidden_size=hidden,
                              intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                              rope_scaling=scaling)  # fmt: skip
    if any(ROWS[n][0] == "gptq" for n in names) and not Path(MODEL_GPTQ, "config.json").is_file():
        quantized_copy(MODEL, MODEL_GPTQ, GPTQ_CONFIG)


def quantized_copy(src: str, dst: str, quantization_config: dict) -> None:
    """A config-only folder: `src`'s config and tokenizer, its config naming a quantized checkpoint's format."""
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads(Path(dst, "config.json").read_text())
    config["quantization_config"] = quantization_config
    Path(dst, "config.json").write_text(json.dumps(config, indent=1))


def profile_decode(llm, tokens: int, path: Path) -> None:
    """The device kernels of one batch-1 request (512 prompt tokens, `tokens` output tokens), by total
    time: where a decode step's time goes (the prefill's kernels are in it once)."""
    from torch.profiler import ProfilerActivity, profile

    from llmserve import SamplingParams

    vocab = llm.config.model_config.arch.vocab_size
    length = min(512, llm.config.scheduler_config.max_model_len - tokens)
    prompt = {"prompt_token_ids": [10 + (i * 7919) % (vocab - 10) for i in range(length)]}
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    llm.generate([prompt], params, use_tqdm=False)  # warm (and the prefix cache then holds the prompt)
    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
    sort = "cuda_time_total" if on_gpu else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
    path.write_text(table)
    print(f"RESULT kernels {path.name}", flush=True)
    print(table[:6000], flush=True)


def cpu_smoke() -> None:
    """The same flow on a CPU with a tiny model and tiny rows (a check of this script, not a measurement)."""
    global MODEL
    MODEL = "/tmp/bench_rows_tiny"
    from llmserve.model.random_model import make_random_model

    make_random_model(MODEL, "llama", vocab_size=512, max_position_embeddings=2048)
    for engine, flags in ENGINES.items():
        quant = ["--quantization", "fp8"] if "--quantization" in flags else []
        quant += ["--kv-cache-dtype", "fp8"] if "--kv-cache-dtype" in flags else []
        quant += flags[flags.index("--enable-lora") :] if "--enable-lora" in flags else []
        ENGINES[engine] = ["--model", MODEL, "--max-model-len", "1024" if engine == "long" else "512",
                           "--max-num-seqs", "16", *quant]  # fmt: skip
    for name, (engine, command, flags) in list(ROWS.items()):
        small = {"512": "16", "256": "8", "1000": "8", "1024": "64", "7680": "300", "16384": "600",
                 "32768": "900", "64": "4", "128": "16"}  # fmt: skip
        ROWS[name] = (engine, command, [small.get(f, f) for f in flags])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--only", default="", help="comma-separated row names (default: all)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model and rows on the CPU: checks the script")
    parser.add_argument("--root", help="import llmserve from this folder (an A/B of two trees)")
    parser.add_argument("--no-sampler-check", action="store_true")
    parser.add_argument("--folders-only", action="store_true", help="write the rows' model folders, and stop")
    parser.add_argument("--profile-decode", type=int, default=0, metavar="TOKENS",
                        help="after each engine's rows: its kernels over one request of 512 prompt and TOKENS output "
                        "tokens (torch.profiler, CUDA graphs' kernels included), to OUT/kernels_ENGINE.txt")  # fmt: skip
    opts = parser.parse_args()
    if opts.root:
        sys.path.insert(0, str(Path(opts.root).resolve()))
        import llmserve

        assert llmserve.__file__.startswith(str(Path(opts.root).resolve())), llmserve.__file__
        print(f"RESULT llmserve from {Path(llmserve.__file__).parent}", flush=True)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    names = opts.only.split(",") if opts.only else list(ROWS)  # in the order given: engines start in that order
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    if opts.cpu_smoke:
        cpu_smoke()
        results: dict = {}
    else:
        make_model_folder(names)
        if opts.folders_only:
            return
        results = {}
        if not opts.no_sampler_check:
            results["sampler_check"] = check_sampler_on_gpu()
            print("RESULT sampler_check", json.dumps(results["sampler_check"]), flush=True)
    from llmserve import LLM
    from llmserve.bench import latency, throughput
    from llmserve.cli_args import engine_args_from_cli
    from llmserve.engine.sampler_reference import ReferenceSampler

    for engine in dict.fromkeys(ROWS[n][0] for n in names):
        rows = [n for n in names if ROWS[n][0] == engine]
        if not rows:
            continue
        started = time.perf_counter()
        llm = LLM(**vars(engine_args_from_cli(bench_args("throughput", ENGINES[engine]))))
        startup = time.perf_counter() - started
        runner = llm.core.runner
        own = runner.sampler  # the engine's own, as `llmserve bench` runs it (on a GPU: its Triton kernels)
        kernels = getattr(own, "use_kernels", False)
        print(f"RESULT engine {engine} ready in {startup:.1f} s; sampler {type(own).__name__}, kernels {'on' if kernels else 'off'}",
              flush=True)  # fmt: skip
        for name in rows:
            _, command, flags = ROWS[name]
            runner.sampler = ReferenceSampler(runner.device) if name.endswith("@reference") else own
            args = bench_args(command, flags)  # every row's result goes to rows.json
            line = f"llmserve bench {command} {shlex.join(ENGINES[engine])} {shlex.join(flags)}"
            if name.endswith("@reference"):
                line += " --sampler reference"
            print(f"=== {name}: {line}", flush=True)
            llm.reset_prefix_cache()  # each row's prompts start cold (rows share prompts: same seed)
            t0 = time.perf_counter()
            result = throughput.measure(llm, args, startup) if command == "throughput" else latency.measure(llm, args)
            record = result if isinstance(result, dict) else vars(result)
            results[name] = {"command": line, "wall_s": round(time.perf_counter() - t0, 1),
                             **{k: v for k, v in record.items() if k not in ("ttfts", "latencies")}}  # fmt: skip
            keys = ("output_tokens_per_s", "ttft_ms", "tpot_ms", "gpu", "lora", "num_preemptions")
            print("RESULT", name, json.dumps({k: record.get(k) for k in keys if k in record}), flush=True)
            (out / "rows.json").write_text(json.dumps(results, indent=1))
        if opts.profile_decode:
            profile_decode(llm, opts.profile_decode, out / f"kernels_{engine}.txt")
        llm.shutdown()
        runner.release_cuda_graphs()
        del llm, runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine sizes its KV cache from what is free


if __name__ == "__main__":
    main()
