"""The index of each row's largest value (the first, on ties), fast for few long rows.

Reference: `torch.argmax(x, dim=-1)`. For a batch of one row of 128,256 logits, torch's
reduction gives the row to one thread block, tens of µs of GPU time a decode step at batch 1
(docs/history/benchmarks.md). Here a row is cut into up to 256 equal chunks: the chunks' maxima and
their first positions in one reduction over many blocks, then the first chunk holding the
largest maximum. The first chunk with the maximum holds its first occurrence, so the result
is argmax's, ties included.
"""

from __future__ import annotations

from functools import lru_cache

import torch

TWO_STAGE_MAX_ROWS = 64  # more rows than this fill the GPU in one stage


@lru_cache(maxsize=16)
def chunk_count(width: int, most: int = 256, shortest: int = 256) -> int:
    """The largest divisor of `width` up to `most` that leaves chunks of `shortest` or more (1: none)."""
    for chunks in range(min(most, width // shortest), 1, -1):
        if width % chunks == 0:
            return chunks
    return 1


def two_stage_argmax(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """argmax over the last dim of a contiguous [B, V] tensor whose V divides into `chunks`."""
    rows, width = x.shape
    size = width // chunks
    best, where = x.view(rows, chunks, size).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (chunk * size + where.gather(-1, chunk)).squeeze(-1)


def stages_for(x: torch.Tensor) -> int:
    """How many chunks `row_argmax` cuts each row of `x` into (1: torch's one-stage argmax): two
    stages on a GPU, for a contiguous 2-D tensor of at most TWO_STAGE_MAX_ROWS rows whose width
    divides into chunks."""
    if not x.is_cuda or x.dim() != 2 or x.shape[0] > TWO_STAGE_MAX_ROWS or not x.is_contiguous():
        return 1
    return chunk_count(x.shape[-1])


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for a 2-D tensor (see `stages_for`)."""
    chunks = stages_for(x)
    return x.argmax(dim=-1) if chunks == 1 else two_stage_argmax(x, chunks)
