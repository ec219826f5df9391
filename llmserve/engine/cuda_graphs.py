"""CUDA graphs: whole-model graphs for decode-only batches, piecewise graphs for the rest.

`DecodeGraphs`: one graph per padded batch size. All graphs share one memory pool and one
set of static input buffers; a batch is copied into the buffers of the smallest captured
size that holds it. Padded rows write no KV (slot -1) and attend to one position of block
0; their outputs are ignored. Capture goes largest first, so the pool is sized by the
largest graph.

`PiecewiseGraphs`: batches with prefill tokens (a prompt, a chunk, mixed with decodes).
The attention launch depends on the batch's shape beyond its token count (sequences, query
lengths), so attention runs eagerly with the real metadata, and the pieces between the
attention calls (norms, projections, rotary, MLP: row-wise, so padding rows cannot change
real ones) replay from graphs captured per padded token count. Without graphs (CPU, or
before capture) the same pieces run eagerly through the same buffers: the reference the
tests compare against the model's plain forward.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from llmserve.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` that holds n (None: n is beyond them all)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, max_batch: int, max_blocks: int, max_seq_len: int, device: torch.device,
        groups: int = 1,
    ) -> None:  # fmt: skip
        """`groups`: KV groups (engine/kv_layout.py), each with its slots and block tables."""
        self.model = model
        self.device = device
        self.max_seq_len = max_seq_len
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.group_slot_mapping = torch.full((groups, max_batch), -1, dtype=torch.long, device=device)
        self.group_block_tables = torch.zeros((groups, max_batch, max_blocks), dtype=torch.int32, device=device)
        self.slot_mapping = self.group_slot_mapping[0]
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = self.group_block_tables[0]
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []

    def _meta(self, n: int) -> AttentionMetadata:
        metas = [
            AttentionMetadata(
                slot_mapping=self.group_slot_mapping[g, :n],
                query_start_loc=self.query_start_loc[: n + 1],
                seq_lens=self.seq_lens[:n],
                block_tables=self.group_block_tables[g, :n],
                max_query_len=1,
                max_seq_len=self.max_seq_len,
            )
            for g in range(self.group_slot_mapping.shape[0])
        ]
        metas[0].groups = tuple(metas[1:])
        return metas[0]

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
        return padded_size(self.sizes, n)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        fill: Callable[[torch.Tensor], None] | None = None,
        group_slots: torch.Tensor | None = None,
        group_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inputs are host tensors of the real batch (n rows); `fill` completes the input
        ids on the device (tokens of the previous step); `group_slots` [G - 1, n] and
        `group_tables` [G - 1, n, width]: KV groups 1, 2, ...'s. Returns hidden [n, H]."""
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
        if group_slots is not None:
            self.group_slot_mapping[1:, :n].copy_(group_slots, non_blocking=True)
            self.group_block_tables[1:, :n, :width].copy_(group_tables, non_blocking=True)
        if n < size:
            self.group_slot_mapping[:, n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.group_block_tables[:, n:size].zero_()
        graph.replay()
        return out[:n]


def mixed_capture_sizes(top: int) -> list[int]:
    """Token counts of the piecewise graphs, up to `top`: every 16 up to 128, every 32 up
    to 512, then every 64 (padding stays under ~12 %)."""
    if top <= 0:
        return []
    sizes = list(range(16, 129, 16)) + list(range(160, 513, 32)) + list(range(576, top + 1, 64))
    sizes = [s for s in sizes if s <= top]
    if not sizes or sizes[-1] != top:
        sizes.append(top)
    return sizes


class PiecewiseGraphs:
    def __init__(self, model: torch.nn.Module, max_tokens: int, device: torch.device) -> None:
        """`model`: a causal LM (model/interface.py): its first/middle/last pieces and attention
        layers; its `shard` gives this rank's head counts."""
        self.inner = model
        self.layers = model.attention_layers()
        a = model.shard
        dtype = model.embedding_dtype()
        self.num_heads, self.head_dim = a.num_heads, a.head_dim
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.q = torch.zeros((max_tokens, a.num_heads, a.head_dim), dtype=dtype, device=device)
        self.k = torch.zeros((max_tokens, a.num_kv_heads, a.head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.attn_out = torch.zeros((max_tokens, a.num_heads * a.head_dim), dtype=dtype, device=device)
        self.residual = torch.zeros((max_tokens, a.hidden_size), dtype=dtype, device=device)
        self.hidden = torch.zeros_like(self.residual)
        self.sizes = mixed_capture_sizes(max_tokens)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def _piece(self, i: int, n: int) -> None:
        """Piece i over the first n rows of the buffers: its outputs are copied into them."""
        if i == 0:
            q, k, v, residual = self.inner.first_piece(self.input_ids[:n], self.positions[:n])
        elif i < len(self.layers):
            q, k, v, residual = self.inner.middle_piece(i, self.attn_out[:n], self.residual[:n], self.positions[:n])
        else:
            self.hidden[:n].copy_(self.inner.last_piece(self.attn_out[:n], self.residual[:n]))
            return
        self.q[:n].copy_(q)
        self.k[:n].copy_(k)
        self.v[:n].copy_(v)
        self.residual[:n].copy_(residual)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for n in sorted(self.sizes, reverse=True):
            graphs = []
            for i in range(len(self.layers) + 1):
                self._piece(i, n)  # warm up: compile kernels, pick GEMM algorithms
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(i, n)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[n] = graphs
        logger.info(
            "captured piecewise CUDA graphs for %d token counts up to %d (%d graphs)",
            len(self.sizes),
            self.sizes[-1],
            len(self.sizes) * (len(self.layers) + 1),
        )

    def padded_size(self, n: int) -> int | None:
        return padded_size(self.sizes, n)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Input ids and positions of the real batch (n tokens; host tensors, pinned on a
        GPU, or device tensors); `fill` completes the input ids on the device. Returns
        hidden [n, H]. Pieces replay their graphs when captured, else run."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        graphs = self.graphs.get(size)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if fill is not None:
            fill(self.input_ids[:n])
        self.positions[:n].copy_(positions, non_blocking=True)
        for i in range(len(self.layers) + 1):
            if i > 0:  # attention of layer i-1, on the real rows only, into the next piece's input
                out = self.attn_out[:n].view(n, self.num_heads, self.head_dim)
                self.layers[i - 1].attend(self.q[:n], self.k[:n], self.v[:n], meta, out=out)
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(i, size)
        return self.hidden[:n]
