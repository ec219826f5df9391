"""The EAGLE proposer of speculative decoding (`"method": "eagle"` and `"eagle3"`): a head over
the target's hidden states (model/eagle.py) proposes K tokens, one forward a token, for the
whole batch at once.

The head's position t holds a pair: the token at t + 1 and the target's feature of position t
(its hidden state there: model/eagle.py). So after a target step, a request of N tokens can feed
pairs up to position N - 2, whose features the target has just computed; the last pair gives
the first proposal, and each proposal is then fed with the head's own output feature.

1. The target keeps the states the head reads on every eager forward (`HiddenCapture`, set only
   when a head is configured); the runner hands them over with the step's rows (`take_hidden`),
   and `HiddenStore` keeps each request's features by position until the head reads them. A
   position computed again (a speculative step's rejected positions, preemption by recompute)
   takes its latest features.
2. Each request's head cache lives in its own block pool (engine/spec_draft_blocks.py, the draft
   model's): positions [0, real) hold pairs of the request's own tokens with the target's
   features. The proposals fed after them carry the head's features, not the target's, so they
   are always rolled back: the next proposal feeds the accepted tokens again with the target's.
3. A request whose earliest features are gone (a prefix-cache hit: the target never computed
   them; the store's bound: `HiddenStore.max_rows`) starts its head cache at its first position
   with features (`base`); the pairs keep their own rotary positions. Acceptance may drop there;
   the tokens do not change (the target verifies every proposal).
4. Drawing is the draft model's (engine/spec_draft.py `draw_proposals`): greedy argmax, or a
   sampled request's draw from its filtered distribution q, which goes with the proposals to the
   target's rejection sampling.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from llmserve.config import EngineConfig
from llmserve.engine.input_builder import InputBuilder, RowInput, table_width
from llmserve.engine.kv_sizing import bytes_per_block
from llmserve.engine.request import Request
from llmserve.engine.spec_draft import draw_proposals
from llmserve.engine.spec_draft_blocks import DraftBlocks
from llmserve.host_copy import to_device
from llmserve.model.attention import AttentionBackend
from llmserve.model.eagle import load_eagle_head
from llmserve.model.interface import CausalLM, HiddenCapture
from llmserve.model.layers import REFERENCE_OPS, triton_ops
from llmserve.model.whole_vocab import WholeVocab

logger = logging.getLogger(__name__)


class HiddenStore:
    """The target's features of recent positions, by request (chunks of consecutive positions, in
    the order computed), at most about `max_rows` rows in all: past it the oldest chunks of the
    least recently computed requests go."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.rows = 0
        self.chunks: OrderedDict[str, list[tuple[int, torch.Tensor]]] = OrderedDict()

    def add(self, rows: list[RowInput], features: torch.Tensor) -> None:
        """A step's features [T, hidden], its rows' tokens in order."""
        offset = 0
        for row in rows:
            chunks = self.chunks.setdefault(row.request_id, [])
            chunks.append((row.start, features[offset : offset + row.count]))
            self.chunks.move_to_end(row.request_id)
            offset += row.count
            self.rows += row.count
        while self.rows > self.max_rows and self.chunks:
            request_id, chunks = next(iter(self.chunks.items()))
            self.rows -= len(chunks.pop(0)[1])
            if not chunks:
                del self.chunks[request_id]

    def gather(self, request_id: str, start: int, end: int) -> tuple[int, torch.Tensor | None]:
        """(s, features of positions [s, end)): s the first position >= `start` from which every
        position up to `end` has features (a later chunk's win); (end, None) if `end - 1` has none."""
        chunks = self.chunks.get(request_id, [])
        s = end
        moved = True
        while moved and s > start:  # the covered suffix, grown chunk by chunk
            moved = False
            for first, c in chunks:
                if first < s <= first + len(c):
                    s, moved = max(start, first), True
        if s == end:
            return end, None
        out = None
        for first, c in chunks:
            lo, hi = max(s, first), min(end, first + len(c))
            if lo < hi:
                if out is None:
                    out = c.new_empty((end - s, c.shape[1]))
                out[lo - s : hi - s] = c[lo - first : hi - first]
        return s, out

    def consumed(self, request_id: str, end: int) -> None:
        """Positions before `end` are in the head's cache: chunks wholly before it go."""
        chunks = self.chunks.get(request_id)
        if chunks is None:
            return
        kept = [(first, c) for first, c in chunks if first + len(c) > end]
        self.rows -= sum(len(c) for first, c in chunks if first + len(c) <= end)
        self.chunks[request_id] = kept

    def forget(self, request_id: str) -> None:
        self.rows -= sum(len(c) for _, c in self.chunks.pop(request_id, []))


class EagleProposer:
    """The head, its KV cache and block tables, the target's features; `propose` as spec_decode's `Proposer`."""

    def __init__(self, config: EngineConfig, device: torch.device, backend: AttentionBackend,
                 target: CausalLM | WholeVocab) -> None:  # fmt: skip
        """`target`: what the head reads the target's embedding (and EAGLE-1's logits) through: the
        model, or under tensor or pipeline parallelism whole tables of its vocabulary (`ModelRunner.proposer_vocab`)."""
        spec, mc, sc = config.speculative.eagle, config.model_config, config.scheduler_config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.chunk = sc.max_num_batched_tokens  # the most pairs a row feeds in one forward
        ops = triton_ops(mc.fp8_fast_accum_tokens) if config.attention_backend == "triton" else REFERENCE_OPS
        self.head = load_eagle_head(spec, target, mc.dtype, device, backend, mc.max_model_len, ops)
        self.arch = spec.arch
        self.kv_dtype = mc.dtype
        self.capture: HiddenCapture = self.head.capture()
        self.store = HiddenStore(4 * sc.max_num_batched_tokens)
        max_blocks = table_width(-(-mc.max_model_len // self.block_size))
        self.inputs = InputBuilder(self.block_size, sc.max_num_seqs, max_blocks, min(mc.max_model_len, 2 * self.chunk))
        self.blocks = DraftBlocks(0, self.block_size)
        self.base: dict[str, int] = {}  # request id -> the target position of its head cache's position 0
        self.kv_caches: list[torch.Tensor] = []
        logger.info("%s head %s: %d layer(s), reads %s", spec.method.upper(), spec.folder, self.arch.num_layers,
                    f"the states entering layers {spec.aux_layers}" if spec.eagle3 else "the final hidden states")  # fmt: skip

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.arch, self.block_size, self.kv_dtype)

    def init_cache(self, num_blocks: int) -> None:
        a = self.arch
        shape = (2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(a.num_layers)]
        for cache, layer in zip(self.kv_caches, self.head.attention_layers()):
            layer.kv_cache = cache
            layer.kv_group = 0
        self.blocks = DraftBlocks(num_blocks, self.block_size)
        logger.info("EAGLE head: %d KV blocks (%d tokens)", num_blocks, num_blocks * self.block_size)

    @torch.inference_mode()
    def take_hidden(self, rows: list[RowInput], states: list[torch.Tensor]) -> None:
        """A target step's captured states (`capture`), its rows' tokens in order."""
        if states:
            self.store.add(rows, self.head.features(states))

    def forget(self, request_id: str) -> None:
        self.blocks.forget(request_id)
        self.store.forget(request_id)
        self.base.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to `ks[i]` proposals for each request (none where its features or the head's pool
        fall short), and for each sampled request the distributions [k, V] they were drawn from."""
        keep = {r.request_id for r in requests}
        rows = [row for req, k in zip(requests, ks) if (row := self._row(req, k, keep)) is not None]
        active = rows
        while active:
            self._forward_and_draw(active)
            active = [r for r in active if len(r.proposals) < r.k]
        done = {}
        for row in rows:
            rid = row.req.request_id
            self.blocks.fed(rid, row.num_real, [])  # (the head's own features: never kept)
            self.store.consumed(rid, self.base[rid] + row.num_real)
            done[rid] = row
        proposals, probs = [], []
        for req in requests:
            row = done.get(req.request_id)
            proposals.append(row.proposals if row is not None else [])
            probs.append(torch.stack(row.probs) if row is not None and row.probs else None)
        return proposals, probs

    def _row(self, req: Request, k: int, keep: set[str]) -> _EagleRow | None:
        """The request's proposal to make: its head cache synced with its tokens and the
        target's features of the pairs it lacks; None if it cannot propose now."""
        rid, tokens = req.request_id, req.all_token_ids
        end = len(tokens) - 1  # pairs 0 .. N - 2: the last pair gives the first proposal
        base = self.base.get(rid)
        fed = self.blocks.sync(rid, tokens[base + 1 :]) if base is not None else 0
        first, features = self.store.gather(rid, fed + (base or 0), end)
        if features is None:
            return None
        if base is None or first > base + fed:  # a new head cache, from the first position with features
            self.blocks.forget(rid)
            base = self.base[rid] = first
            fed = self.blocks.sync(rid, tokens[base + 1 :])
        if not self.blocks.reserve(rid, end - base + k - 1, keep):
            return None
        return _EagleRow(req, k, list(tokens[base + 1 :]), fed, base, features,
                         self.blocks.seqs[rid].block_ids)  # fmt: skip

    def _forward_and_draw(self, rows: list[_EagleRow]) -> None:
        """One forward of the head: each row feeds up to `chunk` of its unfed pairs; the rows whose
        input ends there draw a proposal (fed next time, with the feature the head made for it)."""
        inputs, features, drawing, bases = [], [], [], []
        for row in rows:
            count = min(len(row.tokens) - row.fed, self.chunk)
            if row.fed < row.num_real:
                features.append(row.features[row.fed - row.first : row.fed - row.first + count])
            else:  # a proposal: one pair, the head's own feature
                features.append(row.own_feature)
            samples = row.fed + count == len(row.tokens)
            inputs.append(RowInput(row.req.request_id, row.block_ids, row.fed, count, row.tokens, samples))
            bases.append(np.full(count, row.base, dtype=np.int64))
            row.fed += count
            if samples:
                drawing.append(row)
        batch = self.inputs.build(inputs)
        input_ids, positions, meta = batch.to_device(self.device)
        positions = positions + to_device(np.concatenate(bases), torch.long, self.device)  # (the target's positions)
        states, next_features = self.head(input_ids, positions, torch.cat(features), meta)
        if not drawing:
            return
        at = to_device(batch.logits_indices, torch.long, self.device)
        tokens, probs = draw_proposals(self.head.compute_logits(states[at]), drawing)
        own = next_features[at]
        for i, (row, token) in enumerate(zip(drawing, tokens)):
            row.proposals.append(token)
            row.tokens.append(token)
            row.own_feature = own[i : i + 1]
            if probs is not None and not row.greedy:
                row.probs.append(probs[i])


class _EagleRow:
    """One request's proposal in the making (positions relative to its head cache's `base`)."""

    __slots__ = ("req", "k", "tokens", "fed", "first", "base", "num_real", "features", "own_feature", "block_ids", "greedy",
                 "proposals", "probs")  # fmt: skip

    def __init__(self, req: Request, k: int, tokens: list[int], fed: int, base: int, features: torch.Tensor,
                 block_ids: list[int]) -> None:  # fmt: skip
        self.req = req
        self.k = k
        self.tokens = tokens  # the pairs' tokens (the request's from base + 1), then the proposals
        self.fed = fed  # pairs the head's cache holds
        self.first = fed  # the pair of `features`' first row
        self.base = base
        self.num_real = len(tokens)
        self.features = features  # the target's, of pairs [first, num_real)
        self.own_feature: torch.Tensor | None = None  # the head's feature for the pair fed next
        self.block_ids = block_ids
        self.greedy = req.sampling_params.greedy
        self.proposals: list[int] = []
        self.probs: list[torch.Tensor] = []

    @property
    def next_output_index(self) -> int:
        """The output position of the proposal being drawn (the seeded noise's key)."""
        return self.base + 1 + len(self.tokens) - len(self.req.prompt_token_ids)
