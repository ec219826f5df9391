"""Staged host copies give what `torch.tensor` gives, for every input kind the engine passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.host_copy import kept_on_device, staged, to_device

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
CASES = [
    ([3, 1, 2], torch.long), (list(range(7680)), torch.long), ([], torch.long), ([[1, 2], [3, 4]], torch.int32),
    ([True, 1, 0], torch.long), ([0.5, -2.25], torch.float32), ([1, 2], torch.float32), ([True, False], torch.bool),
    ([0.5, 1.5], torch.bfloat16), ([2**40, -(2**40)], torch.long),
]  # fmt: skip


@pytest.mark.parametrize("values,dtype", CASES, ids=range(len(CASES)))
def test_lists_stage_as_torch_tensor_makes_them(values, dtype):
    got, want = staged(values, dtype, CPU), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(to_device(values, dtype, CPU), want)


def test_arrays_and_tensors_are_converted_to_the_dtype():
    table = np.arange(12, dtype=np.int64).reshape(3, 4)
    assert torch.equal(staged(table, torch.int32, CPU), torch.tensor(table, dtype=torch.int32))
    assert staged(torch.ones(3, dtype=torch.int64), torch.float32, CPU).dtype == torch.float32


def test_a_kept_list_crosses_once_and_each_list_apart():
    from llmserve.engine.penalty_state import PenaltyRows

    pen = PenaltyRows([0, 2], [5, 6], [1.1, 1.0], [0.5, 0.0], [0.0, 0.2])
    rows = kept_on_device(pen, "rows", torch.long, CPU)
    assert torch.equal(rows, torch.tensor([0, 2])) and kept_on_device(pen, "rows", torch.long, CPU) is rows
    assert torch.equal(kept_on_device(pen, "presence", torch.float32, CPU), torch.tensor([0.5, 0.0]))
    assert sorted(pen.copies) == ["presence", "rows"]
    assert PenaltyRows([1], [1], [1.0], [0.0], [0.0]).copies == {}  # each its own cache
