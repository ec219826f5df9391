"""How many KV cache blocks an engine gets: the arithmetic, apart from the profile run that
measures its inputs (the model runner runs that, on every tensor-parallel rank).

On a GPU every byte up to `gpu_memory_utilization` that the profile run's peak, the memory
outside torch's allocator, the sampler's logits work and the CUDA graphs do not need goes to
blocks; on a CPU a fixed budget, at least one sequence of max_model_len."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.config import EngineConfig
from llmserve.engine.kv_layout import KVLayout, plan_layout
from llmserve.model.interface import ModelArch
from llmserve.model.registry import family_of

DEFAULT_CPU_KV_BYTES = 256 << 20


def kv_layout(arch: ModelArch) -> KVLayout:
    """How the layers share the cache (engine/kv_layout.py), from the family's attention specs."""
    specs = family_of(arch).attention(arch)
    return plan_layout([s.window for s in specs], [s.kv_width for s in specs])


def bytes_per_block(arch: ModelArch, block_size: int, kv_dtype: torch.dtype) -> int:
    """Keys and values of `block_size` tokens in the layers one block id covers (of this rank's
    KV heads): every layer with one KV group, a group's layers with several."""
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    specs = family_of(arch).attention(arch)
    layout = kv_layout(arch)
    if layout.num_groups == 1:
        widths = sum(spec.kv_width for spec in specs)
    else:
        widths = layout.layers_per_group * specs[0].kv_width
    return 2 * block_size * widths * elem


def cpu_num_blocks(block_bytes: int, block_size: int, max_model_len: int, max_num_seqs: int,
                   layout: KVLayout | None = None) -> int:  # fmt: skip
    """Blocks on a CPU: DEFAULT_CPU_KV_BYTES, no more than every sequence can use, and at least
    one sequence of max_model_len (SmolLM2's 8,192 tokens need 377 MB); with several KV groups a
    sequence's prompt computed in one step holds a block per group, and a sliding layout
    reserves one block (kv_layout.NULL_BLOCK)."""
    per_seq = -(-max_model_len // block_size)
    reserved = 0
    if layout is not None:
        per_seq *= layout.num_groups
        reserved = int(layout.sliding)
    max_useful = max_num_seqs * per_seq + 1 + reserved
    return max(1, per_seq + reserved, min(DEFAULT_CPU_KV_BYTES // block_bytes, max_useful))


def graph_memory_reserve(config: EngineConfig, activations: int, num_tokens: int) -> int:
    """Bytes the CUDA graphs will hold, kept out of the KV budget: 1 GiB for the decode
    graphs, plus the piecewise graphs' pool, which holds the activations of their largest
    token count (a share of the `activations` the profile run needed for `num_tokens`)."""
    if config.enforce_eager:
        return 0
    mixed_tokens = min(config.max_mixed_graph_tokens, num_tokens)
    return (1 << 30) + activations * mixed_tokens // num_tokens


@dataclass(frozen=True)
class KVBudget:
    """Where a GPU's memory under `gpu_memory_utilization` goes, in bytes: what the KV cache is left."""

    allowed: int  # total x gpu_memory_utilization
    total: int
    weights: int
    activations: int  # the profile run's peak without its small KV cache and the weights
    non_torch: int  # this process's memory outside torch's allocator (CUDA context, cuBLAS, NCCL)
    sampler: int
    graphs: int

    @property
    def kv_bytes(self) -> int:
        return self.allowed - self.weights - self.activations - self.non_torch - self.sampler - self.graphs

    def describe(self) -> str:
        gb = 1e9
        return (f"of {self.allowed / gb:.2f} GB allowed ({self.allowed / self.total:.2f} of {self.total / gb:.1f} GB): "
                f"weights {self.weights / gb:.2f}, the profile run's activations {self.activations / gb:.2f}, "
                f"outside torch's allocator {self.non_torch / gb:.2f}, sampler {self.sampler / gb:.2f}, "
                f"CUDA graphs {self.graphs / gb:.2f}: KV cache {self.kv_bytes / gb:.2f} GB")  # fmt: skip


def kv_budget(config: EngineConfig, total: int, peak: int, kv_bytes: int, weights: int, non_torch: int,
              vocab_size: int) -> KVBudget:  # fmt: skip
    """The KV budget's parts on a GPU of `total` bytes, after a profile run of the largest batch that
    peaked at `peak` bytes of torch's allocator, `kv_bytes` of them its small KV cache and `weights`
    the weights (0 when they live in an arena: then they are in `non_torch`, this process's
    memory outside the allocator)."""
    sc = config.scheduler_config
    # not seen by the profile run: the sampler's float32 work on the logits, CUDA graphs
    sampler = 8 * sc.max_num_seqs * vocab_size * 4
    activations = peak - kv_bytes - weights  # (negative with the weights in an arena: counted in non_torch)
    graphs = graph_memory_reserve(config, activations=max(0, activations), num_tokens=sc.max_num_batched_tokens)
    return KVBudget(allowed=int(total * config.cache_config.gpu_memory_utilization), total=total, weights=weights,
                    activations=activations, non_torch=max(0, non_torch), sampler=sampler, graphs=graphs)  # fmt: skip
