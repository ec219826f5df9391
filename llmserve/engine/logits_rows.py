"""The rows a step computes logits for, padded to few distinct counts on a GPU.

The LM head is one GEMM of [rows, hidden] by [hidden, vocab]. cuBLAS picks its kernel by the
row count, and the first launch of a kernel not used before in the process loads its module
(CUDA's lazy loading), which blocks the host until the device has run everything queued: a
step's LM head blocked for hundreds of ms the first time a run met a new row count, and the
GPU then waited for the host's next launch (scripts/gpu/front_probe.py; docs/history/benchmarks.md).
With the counts padded to a multiple of ROW_MULTIPLE above ROW_MULTIPLE, a batch of up to 1,024 rows
takes 79 counts, which the warm-up runs once each (`warm_counts`).

Padding costs nothing that matters: up to about 150 rows the GEMM reads the whole head weight
whatever the count (memory-bound), and past that at most 15 rows more in hundreds. The padded
rows repeat the last real row; their logits are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmserve.host_copy import to_device

ROW_MULTIPLE = 16


def padded_count(n: int) -> int:
    """The row count a GPU computes logits for, for `n` rows that sample."""
    return n if n <= ROW_MULTIPLE else -(-n // ROW_MULTIPLE) * ROW_MULTIPLE


def warm_counts(max_rows: int) -> list[int]:
    """Every padded count of 1 to `max_rows` rows: the LM head's shapes a step can take."""
    return sorted({padded_count(n) for n in range(1, max_rows + 1)})


def is_range(values: list[int], start: int) -> bool:
    """Is `values` start, start + 1, ..., start + len - 1?"""
    return all(v == start + i for i, v in enumerate(values))


def step_logits(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                rows: list[int], pad: bool) -> torch.Tensor:  # fmt: skip
    """Logits of `hidden`'s `rows`, in order. With `pad`, the GEMM runs on `padded_count` rows
    (the last row repeated) and the extra rows' logits are cut off; the real rows' are the
    same as without (`compute_logits` treats rows independently)."""
    n = len(rows)
    count = padded_count(n) if pad else n
    if count == n and n == hidden.shape[0] and is_range(rows, 0):  # every row samples (decode): no gather
        return compute_logits(hidden)
    index = rows + [rows[-1]] * (count - n)
    logits = compute_logits(hidden[to_device(index, torch.long, hidden.device)])
    return logits[:n] if count > n else logits
