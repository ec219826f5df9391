"""The LM head's rows padded to few counts (engine/logits_rows.py) against the plain rows."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.logits_rows import ROW_MULTIPLE, padded_count, step_logits, warm_counts

pytestmark = pytest.mark.unit


def test_padded_counts_are_few_and_cover_every_batch():
    counts = warm_counts(1024)
    assert len(counts) == 79 and counts[:16] == list(range(1, 17)) and counts[-1] == 1024
    for n in range(1, 1025):
        m = padded_count(n)
        assert m in counts and n <= m < n + ROW_MULTIPLE
        assert m == n or m % ROW_MULTIPLE == 0
    assert warm_counts(40) == list(range(1, 17)) + [32, 48]  # past the batch limit: one padded count


@pytest.mark.parametrize("rows, hidden_rows", [
    (list(range(5)), 5),  # a small decode: no padding
    (list(range(17)), 17),  # decode of 17 rows: padded to 32
    (list(range(40)), 64),  # the first 40 of a longer hidden
    ([3, 9, 10, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 50, 63], 64),  # prompt ends and decodes
    ([7], 8),
])  # fmt: skip
def test_padded_logits_equal_the_plain_rows(rows, hidden_rows):
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 97, bias=False)
    hidden = torch.randn(hidden_rows, 24)
    shapes = []

    def compute(h: torch.Tensor) -> torch.Tensor:
        shapes.append(h.shape[0])
        return head(h)

    with torch.inference_mode():
        plain = step_logits(compute, hidden, rows, pad=False)
        padded = step_logits(compute, hidden, rows, pad=True)
        reference = head(hidden)[rows]
    assert shapes == [len(rows), padded_count(len(rows))]
    assert padded.shape == plain.shape == (len(rows), 97)
    # equal up to the GEMM's rounding (which differs with the row count, on a CPU as well)
    torch.testing.assert_close(plain, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-6)
