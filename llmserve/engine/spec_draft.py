"""The draft model proposer of speculative decoding (`"method": "draft_model"`): a smaller model
of the target's tokenizer proposes K tokens, one forward a token, for the whole batch at once.

Each step, for the requests that speculate (engine/spec_decode.py chose them and their K):
1. each request's draft cache is synced with its tokens (engine/spec_draft_blocks.py: the
   proposals the target accepted stay, the rest are rolled back) and given blocks for the
   positions this proposal writes;
2. forwards of the draft over the batch: each request feeds what its draft cache lacks (its
   whole sequence the first time, in chunks of at most `max_num_batched_tokens`; after that the
   target's last token, and a proposal the draft did not feed), and every row whose input ends
   there draws its next proposal from the draft's logits; then one token a row a forward, until
   each has its k proposals (the k-th is proposed, not fed);
3. a greedy request's proposal is the draft's argmax; a sampled one's is drawn from the draft's
   distribution q under the request's own temperature, top-k, top-p and min-p, and q goes with
   the proposals to the target's rejection sampling (accept min(1, p/q), else draw from
   max(0, p - q)), which keeps the target's distribution whatever q is. A seeded request draws
   from noise keyed by (its seed mixed with DRAFT_SEED_MIX, output position), a stream apart
   from the target's, so it reproduces.

The draft runs in the engine core's process on the target's device and dtype, eagerly (no CUDA
graphs), with the target's attention backend, before the target's step that verifies what it
proposed. Its KV cache is its own (`init_cache`; sizing in `draft_cache_blocks`).
"""

from __future__ import annotations

import logging

import torch

from llmserve.config import EngineConfig
from llmserve.engine import seeded_noise
from llmserve.engine.argmax import row_argmax
from llmserve.engine.input_builder import InputBuilder, RowInput, table_width
from llmserve.engine.kv_sizing import bytes_per_block, cpu_num_blocks
from llmserve.engine.request import Request
from llmserve.engine.sampler_reference import apply_top_k_top_p_min_p
from llmserve.engine.spec_draft_blocks import DraftBlocks
from llmserve.model.attention import AttentionBackend
from llmserve.model.layers import REFERENCE_OPS, triton_ops
from llmserve.model.loader import load_model

logger = logging.getLogger(__name__)

DRAFT_SEED_MIX = 0x5DEECE66D_2545F491  # a seeded request's draft noise: its seed xor this (not the target's stream)


def draft_cache_blocks(config: EngineConfig, device: torch.device, target_blocks: int, target_block_bytes: int,
                       draft_block_bytes: int) -> tuple[int, int]:  # fmt: skip
    """(the target's blocks, the draft's): on a CPU the target keeps its count and the draft gets
    the CPU rule's own (`cpu_num_blocks`); on a GPU with a set block count both get it; else the
    target's byte budget is shared so that both hold the same number of tokens."""
    sc = config.scheduler_config
    if device.type != "cuda":
        bs = config.cache_config.block_size
        return target_blocks, cpu_num_blocks(draft_block_bytes, bs, sc.max_model_len, sc.max_num_seqs)
    if config.cache_config.num_gpu_blocks_override is not None:
        return target_blocks, target_blocks
    shared = target_blocks * target_block_bytes // (target_block_bytes + draft_block_bytes)
    return shared, shared


class DraftProposer:
    """The draft model, its KV cache and block tables; `propose` as spec_decode's `Proposer`."""

    def __init__(self, config: EngineConfig, device: torch.device, backend: AttentionBackend) -> None:
        spec, mc = config.speculative, config.model_config
        sc = config.scheduler_config
        self.device = device
        self.arch = spec.draft_arch
        self.block_size = config.cache_config.block_size
        self.chunk = sc.max_num_batched_tokens  # the most tokens a row feeds in one forward
        triton = config.attention_backend == "triton"
        self.model = load_model(spec.model, self.arch, mc.dtype, str(device), backend, seed=mc.seed, progress=False,
                                max_positions=mc.max_model_len, ops=triton_ops(mc.fp8_fast_accum_tokens) if triton else REFERENCE_OPS)  # fmt: skip
        self.kv_dtype = mc.dtype
        max_blocks = table_width(-(-mc.max_model_len // self.block_size))
        self.inputs = InputBuilder(self.block_size, sc.max_num_seqs, max_blocks, min(mc.max_model_len, 2 * self.chunk))
        self.blocks = DraftBlocks(0, self.block_size)
        self.kv_caches: list[torch.Tensor] = []

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.arch, self.block_size, self.kv_dtype)

    def init_cache(self, num_blocks: int) -> None:
        """The draft's KV cache: one tensor a layer, `num_blocks` blocks."""
        a = self.arch
        shape = (2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(a.num_layers)]
        for i, layer in enumerate(self.model.attention_layers()):
            layer.kv_cache = self.kv_caches[i]
            layer.kv_group = 0
        self.blocks = DraftBlocks(num_blocks, self.block_size)
        logger.info("draft model %s: %d KV blocks (%d tokens)", self.arch.architecture, num_blocks,
                    num_blocks * self.block_size)  # fmt: skip

    def forget(self, request_id: str) -> None:
        self.blocks.forget(request_id)

    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to `ks[i]` proposals for each request (none where the draft's pool cannot hold its
        positions), and for each sampled request the draft distributions [k, V] they were drawn from."""
        keep = {r.request_id for r in requests}
        rows: list[_DraftRow] = []
        for req, k in zip(requests, ks):
            tokens = req.all_token_ids
            start = self.blocks.sync(req.request_id, tokens)
            if self.blocks.reserve(req.request_id, len(tokens) + k - 1, keep):
                rows.append(_DraftRow(req, k, list(tokens), start, self.blocks.seqs[req.request_id].block_ids))
        active = rows
        while active:
            self._forward_and_draw(active)
            active = [r for r in active if len(r.proposals) < r.k]
        for row in rows:
            self.blocks.fed(row.req.request_id, row.num_real, row.proposals[:-1])
        done = {r.req.request_id: r for r in rows}
        proposals: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for req in requests:
            row = done.get(req.request_id)
            proposals.append(row.proposals if row is not None else [])
            probs.append(torch.stack(row.probs) if row is not None and row.probs else None)
        return proposals, probs

    def _forward_and_draw(self, rows: list[_DraftRow]) -> None:
        """One forward of the draft: each row feeds up to `chunk` of its unfed tokens; the rows whose
        input ends there draw a proposal (appended to their tokens, fed next time)."""
        inputs, drawing = [], []
        for row in rows:
            count = min(len(row.tokens) - row.fed, self.chunk)
            samples = row.fed + count == len(row.tokens)
            inputs.append(RowInput(row.req.request_id, row.block_ids, row.fed, count, row.tokens, samples))
            row.fed += count
            if samples:
                drawing.append(row)
        batch = self.inputs.build(inputs)
        input_ids, positions, meta = batch.to_device(self.device)
        if not drawing:  # chunks of long sequences, none at its end yet
            self.model(input_ids, positions, meta)
            return
        if len(batch.logits_indices) < len(batch.input_ids):  # the last layer on the drawing rows alone
            hidden = self.model(input_ids, positions, meta, batch.sampled_rows(meta, self.device))
        else:  # one token a row, each drawing: the rows are the logits rows
            hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden)
        tokens, probs = self._draw(logits, drawing)
        for i, (row, token) in enumerate(zip(drawing, tokens)):
            row.proposals.append(token)
            row.tokens.append(token)
            if probs is not None and not row.greedy:
                row.probs.append(probs[i])

    def _draw(self, logits: torch.Tensor, rows: list[_DraftRow]) -> tuple[list[int], torch.Tensor | None]:
        return draw_proposals(logits, rows)


def draw_proposals(logits: torch.Tensor, rows: list) -> tuple[list[int], torch.Tensor | None]:
    """Each row's proposal: the argmax for a greedy request; for a sampled one a draw from its
    filtered distribution q (returned, [rows, V], for the target's rejection sampling). A row has
    `req`, `greedy` and `next_output_index` (the output position drawn: a seeded row's noise key)."""
    if all(r.greedy for r in rows):
        return row_argmax(logits).tolist(), None
    params = [r.req.sampling_params for r in rows]
    temperatures = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
    filtered = apply_top_k_top_p_min_p(logits.float() / temperatures[:, None], [p.top_k for p in params],
                                       [p.top_p for p in params], [p.min_p for p in params])  # fmt: skip
    probs = torch.softmax(filtered, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
    if seeded:
        keys = torch.tensor([seeded_noise.row_key(params[i].seed ^ DRAFT_SEED_MIX, rows[i].next_output_index)
                             for i in seeded], device=logits.device)  # fmt: skip
        vocab = torch.arange(probs.shape[1], device=logits.device)
        noise[torch.tensor(seeded, device=logits.device)] = seeded_noise.exponential(keys, vocab)
    drawn = row_argmax(probs.log() - noise.log())
    greedy = torch.tensor([r.greedy for r in rows], device=logits.device)
    return torch.where(greedy, row_argmax(logits), drawn).tolist(), probs


class _DraftRow:
    """One request's proposal in the making."""

    __slots__ = ("req", "k", "tokens", "fed", "num_real", "block_ids", "greedy", "proposals", "probs")

    def __init__(self, req: Request, k: int, tokens: list[int], fed: int, block_ids: list[int]) -> None:
        self.req = req
        self.k = k
        self.tokens = tokens  # the request's tokens, then the proposals so far
        self.fed = fed  # positions whose KV the draft holds (from the sync, then this step's forwards)
        self.num_real = len(tokens)
        self.block_ids = block_ids
        self.greedy = req.sampling_params.greedy
        self.proposals: list[int] = []
        self.probs: list[torch.Tensor] = []  # a sampled request's q of each proposal

    @property
    def next_output_index(self) -> int:
        """The output position of the proposal being drawn (the seeded noise's key)."""
        return len(self.tokens) - len(self.req.prompt_token_ids)
