"""The embedding table in int8 (`--int8-embedding`, with `--quantization int8`): each vocabulary row
in int8 with a float32 scale of its own (amax / 127, symmetric, round to nearest even: the INT8
projections' per-row quantization, model/int8.py), dequantized on lookup into the model's dtype.

A table of V x H values takes V x (H + 4) bytes instead of V x H x 2 in bfloat16 (SmolLM2-135M's
49,152 x 576: 28.5 MB against 56.6 MB). The rows a step looks up are dequantized as they are read
(q * scale in float32, rounded to the model's dtype): the same values as a float table holding
the dequantized rows.

The LM head: an untied head (its own `lm_head.weight`) stays in the model's dtype. A tied head
(the embedding's rows are the LM head's, as SmolLM2's and Gemma 3's) reads the same int8 rows:
dequantized `LOGIT_ROWS` rows at a time into the activations' dtype and multiplied, so the table
is never whole in 16 bits (the logits of a float model holding the dequantized rows). That keeps
the memory saved, at the cost of writing and reading each chunk once more per step than a 16-bit
head reads its table.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.int8 import dequantize_int8
from llmserve.model.tensor_parallel import TPGroup, VocabParallelEmbedding

logger = logging.getLogger(__name__)

LOGIT_ROWS = 8192  # vocabulary rows a tied LM head dequantizes at a time


class Int8VocabParallelEmbedding(VocabParallelEmbedding):
    """`VocabParallelEmbedding` (this rank's vocabulary rows, padded up) with int8 rows and a float32
    scale per row; lookups and a tied LM head's logits come out in `out_dtype`."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, out_dtype: torch.dtype) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.out_dtype = out_dtype
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(self.per_rank, 1, dtype=torch.float32), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtype

    def fp8_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(int8 weight, its float32 scale): kept in float32 at load, drawn as a pair for dummy weights."""
        return [(self.weight, self.weight_scale)]

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = F.embedding(ids, self.weight)
        return dequantize_int8(q, F.embedding(ids, self.weight_scale)).to(self.out_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._rows(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = self._rows(local.clamp(0, self.per_rank - 1)) * inside.unsqueeze(-1).to(self.out_dtype)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, linear=F.linear) -> torch.Tensor:
        if weight is not None:  # an untied LM head: its own 16-bit rows
            return super().logits(hidden, weight, linear)
        local = torch.empty(*hidden.shape[:-1], self.per_rank, dtype=hidden.dtype, device=hidden.device)
        for start in range(0, self.per_rank, LOGIT_ROWS):
            rows = slice(start, min(start + LOGIT_ROWS, self.per_rank))
            w = dequantize_int8(self.weight[rows], self.weight_scale[rows]).to(hidden.dtype)
            local[..., rows] = linear(hidden, w)
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]


def use_int8_embedding(model: nn.Module, dtype: torch.dtype) -> Int8VocabParallelEmbedding | None:
    """Swap the model's embedding (on the meta device, before memory is allocated) for its int8 form;
    None when this rank holds no embedding (a pipeline stage's middle)."""
    inner = model.model
    old = inner.embed_tokens
    if not isinstance(old, VocabParallelEmbedding) or old.weight is None:
        return None
    new = Int8VocabParallelEmbedding(old.vocab_size, old.weight.shape[1], old.tp, dtype)
    inner.embed_tokens = new
    return new


def embedding_bytes(embedding: Int8VocabParallelEmbedding) -> tuple[int, int]:
    """(bytes this rank's int8 table and its scales take, bytes it would take in the model's dtype)."""
    rows, hidden = embedding.weight.shape
    int8 = embedding.weight.numel() + embedding.weight_scale.numel() * embedding.weight_scale.element_size()
    return int8, rows * hidden * torch.empty(0, dtype=embedding.out_dtype).element_size()


def log_saving(embedding: Int8VocabParallelEmbedding, tied: bool) -> None:
    int8, full = embedding_bytes(embedding)
    rows, hidden = embedding.weight.shape
    logger.info("INT8 embedding: %d x %d rows in int8 with a float32 scale each, %.1f MB against %.1f MB in %s "
                "(%.1f MB saved%s)", rows, hidden, int8 / 1e6, full / 1e6, str(embedding.out_dtype).removeprefix("torch."),
                (full - int8) / 1e6, "; the tied LM head reads the same rows" if tied else "; the LM head stays "
                "in the model's dtype")  # fmt: skip


__all__ = ["LOGIT_ROWS", "Int8VocabParallelEmbedding", "embedding_bytes", "log_saving", "use_int8_embedding"]
