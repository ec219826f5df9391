"""The two-stage argmax (llmserve/engine/argmax.py) against torch.argmax: the same index on
random rows, on ties within a chunk and across chunks (the first occurrence), with -inf."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.argmax import chunk_count, row_argmax, two_stage_argmax

pytestmark = pytest.mark.unit


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


def test_two_stages_only_where_they_pay(monkeypatch):
    """The decision, on stand-ins for CUDA tensors: few contiguous rows of a divisible width."""
    from llmserve.engine import argmax

    class Cuda:
        def __init__(self, rows, width, contiguous=True, dims=2):
            self.shape = (rows, width) if dims == 2 else (width,)
            self.is_cuda, self._contiguous = True, contiguous

        def dim(self):
            return len(self.shape)

        def is_contiguous(self):
            return self._contiguous

    assert argmax.stages_for(Cuda(1, 128256)) == 256
    assert argmax.stages_for(Cuda(64, 128256)) == 256
    assert argmax.stages_for(Cuda(65, 128256)) == 1  # enough rows to fill the GPU in one stage
    assert argmax.stages_for(Cuda(4, 128256, contiguous=False)) == 1  # cannot be viewed in chunks
    assert argmax.stages_for(Cuda(4, 1021)) == 1  # a prime width
    assert argmax.stages_for(Cuda(4, 128256, dims=1)) == 1
    assert argmax.stages_for(torch.randn(2, 128256)) == 1  # a CPU tensor: torch's argmax
    monkeypatch.setattr(argmax, "TWO_STAGE_MAX_ROWS", 0)
    assert argmax.stages_for(Cuda(1, 128256)) == 1


def test_row_argmax_takes_the_two_stages_it_is_told_to(monkeypatch):
    """row_argmax through the two-stage path (the decision forced on the CPU): argmax's indices."""
    from llmserve.engine import argmax

    x = torch.randn(3, 32000, generator=torch.Generator().manual_seed(1))
    x[1, 5] = x[1, 31999] = 50.0
    calls = []
    monkeypatch.setattr(argmax, "stages_for", lambda t: calls.append(1) or chunk_count(t.shape[-1]))
    monkeypatch.setattr(argmax, "two_stage_argmax", lambda t, c: calls.append(c) or two_stage_argmax(t, c))
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert calls == [1, 125]
