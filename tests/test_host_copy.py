"""Staged host copies give what `torch.tensor` gives, for every input kind the engine passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.engine.host_copy import staged, to_device

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
