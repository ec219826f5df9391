"""Runs the model on one scheduled batch: flatten inputs, forward, sample.

Owns the device-side state: the model, the paged KV cache (one tensor per layer), the
CPU swap cache, and the per-request random generators of the sampler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.config import EngineConfig
from llmserve.engine.request import TokenLogprobs
from llmserve.engine.sampler import Sampler
from llmserve.engine.scheduler import SchedulerOutput
from llmserve.model.attention import AttentionMetadata, reference_paged_attention
from llmserve.model.loader import load_model

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 256 << 20


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, list[TokenLogprobs]]


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that sample


class ModelRunner:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        mc = config.model_config
        self.device = torch.device(config.device)
        self.dtype = mc.dtype
        self.block_size = config.cache_config.block_size
        self.arch = mc.arch
        self.model = load_model(
            mc.model, mc.arch, mc.dtype, config.device, reference_paged_attention,
            load_format=mc.load_format, seed=mc.seed, progress=progress,
        )  # fmt: skip
        self.sampler = Sampler(self.device)
        self.kv_caches: list[torch.Tensor] = []
        self.cpu_caches: list[torch.Tensor] = []

    # -- KV cache sizing ----------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * elem

    def num_blocks_for_memory(self) -> int:
        """Device blocks: the override, else a byte budget (CPU) or what the GPU has left."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        else:
            sc = self.config.scheduler_config
            max_useful = sc.max_num_seqs * -(-sc.max_model_len // self.block_size) + 1
            return max(1, min(DEFAULT_CPU_KV_BYTES // self.bytes_per_block, max_useful))
        return max(0, budget // self.bytes_per_block)

    def num_swap_blocks(self) -> int:
        return self.config.cache_config.swap_space_bytes // self.bytes_per_block

    def _profile_free_gpu_memory(self) -> int:
        """Run the largest batch once; what is left under the utilization goes to KV."""
        sc = self.config.scheduler_config
        num_tokens = sc.max_num_batched_tokens
        num_seqs = min(sc.max_num_seqs, num_tokens)
        blocks_needed = num_seqs * (-(-sc.max_model_len // self.block_size)) + 1
        blocks = min(blocks_needed, -(-num_tokens // self.block_size) + num_seqs)
        self.init_kv_cache(blocks, 0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seq_len = -(-num_tokens // num_seqs)
        self._dummy_forward(num_seqs, seq_len)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        kv_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        self.kv_caches = []
        free, total = torch.cuda.mem_get_info()
        non_torch = (total - free) - torch.cuda.memory_reserved()
        budget = int(total * self.config.cache_config.gpu_memory_utilization)
        return budget - (peak - kv_bytes) - max(0, non_torch)

    def _dummy_forward(self, num_seqs: int, seq_len: int) -> None:
        bs = self.block_size
        blocks_per_seq = -(-seq_len // bs)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
        tables = [[b % self.kv_caches[0].shape[1] for b in t] for t in tables]
        items = [(tables[i], 0, seq_len, [0] * seq_len, True) for i in range(num_seqs)]
        batch = self._build_batch(items)
        with torch.inference_mode():
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
            self.model.compute_logits(hidden[batch.logits_indices])

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        a = self.arch
        shape = (2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(a.num_layers)
        ]
        for layer, cache in zip(self.model.attention_layers(), self.kv_caches):
            layer.kv_cache = cache
        cpu_shape = (2, num_cpu_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        pin = self.device.type == "cuda"
        self.cpu_caches = [
            torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin) for _ in range(a.num_layers)
        ] if num_cpu_blocks else []  # fmt: skip

    # -- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(sched.finished_request_ids)
        self._swap(sched.blocks_to_swap_out, to_cpu=True)
        self._swap(sched.blocks_to_swap_in, to_cpu=False)
        if not sched.scheduled:
            return ModelRunnerOutput({}, {})
        items = [
            (s.block_table, s.request.num_computed_tokens, s.num_new_tokens,
             s.request.all_token_ids, s.samples)
            for s in sched.scheduled
        ]  # fmt: skip
        batch = self._build_batch(items)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        sampling = [s.request for s in sched.scheduled if s.samples]
        if not sampling:
            return ModelRunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        result = self.sampler(logits, sampling)
        sampled = {r.request_id: t for r, t in zip(sampling, result.token_ids)}
        logprobs = {
            r.request_id: [lp] for r, lp in zip(sampling, result.logprobs) if lp is not None
        }
        return ModelRunnerOutput(sampled, logprobs)

    def _build_batch(self, items: list[tuple[list[int], int, int, list[int], bool]]) -> BatchInputs:
        """items: (block table, first new position, number of new tokens, all tokens, samples)."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_start = [0]
        seq_lens, logits_indices = [], []
        max_blocks = max(len(it[0]) for it in items)
        tables = np.zeros((len(items), max_blocks), dtype=np.int32)
        for i, (table, start, count, tokens, samples) in enumerate(items):
            end = start + count
            pos = np.arange(start, end)
            table_arr = np.asarray(table, dtype=np.int64)
            tables[i, : len(table)] = table_arr
            input_ids.append(np.asarray(tokens[start:end], dtype=np.int64))
            positions.append(pos)
            slots.append(table_arr[pos // bs] * bs + pos % bs)
            query_start.append(query_start[-1] + count)
            seq_lens.append(end)
            if samples:
                logits_indices.append(query_start[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(it[2] for it in items),
            max_seq_len=max(seq_lens),
        )
        return BatchInputs(
            input_ids=torch.from_numpy(np.concatenate(input_ids)).to(dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
        )

    def _swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        for dev_cache, cpu_cache in zip(self.kv_caches, self.cpu_caches):
            if to_cpu:
                cpu_cache[:, dst_ids] = dev_cache[:, src_ids.to(self.device)].to("cpu")
            else:
                dev_cache[:, dst_ids.to(self.device)] = cpu_cache[:, src_ids].to(self.device)
