"""The two-stage argmax (llmserve/engine/argmax.py) against torch.argmax: the same index on
random rows, on ties within a chunk and across chunks (the first occurrence), with -inf."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.argmax import chunk_count, row_argmax, two_stage_argmax


def test_chunk_count_divides_the_row_into_long_chunks():
    assert chunk_count(128256) == 256 and 128256 % 256 == 0  # Llama 3's vocabulary: 256 chunks of 501
    assert chunk_count(32000) == 125  # 256 tokens each
    assert chunk_count(151936) == 128  # Qwen2's: 128 chunks of 1,187
    assert chunk_count(100) == 1 and chunk_count(1021) == 1  # too short / a prime: one stage


@pytest.mark.parametrize("width", [128256, 32000, 4096])
def test_two_stage_argmax_is_argmax(width):
    g = torch.Generator().manual_seed(width)
    chunks = chunk_count(width)
    assert chunks > 1
    x = torch.randn(5, width, generator=g)
    size = width // chunks
    x[1, :] = 0.0  # all equal: the first index
    x[2, 3 * size + 7] = x[2, 9 * size + 1] = 100.0  # a tie across chunks: the earlier chunk
    x[3, 2 * size + 5] = x[3, 2 * size + 2] = 100.0  # a tie inside a chunk: the earlier position
    x[4, :] = float("-inf")
    x[4, width - 1] = -1e30  # the only finite value, in the last chunk
    assert torch.equal(two_stage_argmax(x, chunks), x.argmax(dim=-1))
    assert two_stage_argmax(x, chunks).tolist()[1:] == [0, 3 * size + 7, 2 * size + 2, width - 1]


def test_row_argmax_falls_back_where_one_stage_is_enough():
    x = torch.randn(3, 128256)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))  # a CPU tensor: torch's argmax
    assert torch.equal(row_argmax(x[:, :100]), x[:, :100].argmax(dim=-1))  # not contiguous
