"""CUDA graphs for decode-only batches: one graph per padded batch size.

All graphs share one memory pool and one set of static input buffers; a batch is
copied into the buffers of the smallest captured size that holds it. Padded rows write
no KV (slot -1) and attend to one position of block 0; their outputs are ignored.
Capture goes largest first, so the pool is sized by the largest graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from llmserve.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks: int, max_seq_len: int, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.max_seq_len = max_seq_len
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        pool = None
        for n in sorted(sizes, reverse=True):
            meta = self._meta(n)
            for _ in range(2):  # warm up: compile kernels, settle the allocator
                self.model(self.input_ids[:n], self.positions[:n], meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.input_ids[:n], self.positions[:n], meta)
            pool = graph.pool()
            self.graphs[n] = (graph, out)
        self.sizes = sorted(self.graphs)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def padded_size(self, n: int) -> int | None:
        for size in self.sizes:
            if size >= n:
                return size
        return None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor,
            fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Inputs are host tensors of the real batch (n rows); `fill` completes the input
        ids on the device (tokens of the previous step). Returns hidden [n, H]."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        graph, out = self.graphs[size]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if fill is not None:
            fill(self.input_ids[:n])
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if n < size:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()
        graph.replay()
        return out[:n]
