"""Block tables of the running requests as rows of one array, kept between steps.

A request's block list only grows while it runs, so each step copies just its new
block ids. A request whose list object changed (preempted and re-admitted, swapped
back in) is copied afresh; rows of requests not scheduled in a step are released.
"""

from __future__ import annotations

import numpy as np


class BlockTableBuffer:
    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.max_blocks = max_blocks
        self._rows: dict[str, tuple[int, list[int], int]] = {}  # id -> (row, list, copied)
        self._free = list(range(max_rows - 1, -1, -1))

    def rows_for(self, requests: list[tuple[str, list[int]]]) -> np.ndarray:
        """Row index of each (request id, block list), in order, after syncing the rows."""
        live = {rid for rid, _ in requests}
        for rid in [r for r in self._rows if r not in live]:
            self._free.append(self._rows.pop(rid)[0])
        out = np.empty(len(requests), dtype=np.int64)
        for i, (rid, blocks) in enumerate(requests):
            out[i] = self._sync(rid, blocks)
        return out

    def _sync(self, rid: str, blocks: list[int]) -> int:
        n = len(blocks)
        if n > self.max_blocks:
            raise ValueError(f"request {rid} has {n} blocks, more than the table's {self.max_blocks}")
        entry = self._rows.get(rid)
        if entry is not None and entry[1] is blocks and entry[2] <= n:
            row, _, copied = entry
            if n > copied:
                self.table[row, copied:n] = blocks[copied:n]
        else:
            row = entry[0] if entry is not None else self._free.pop()
            self.table[row, :n] = blocks
        self._rows[rid] = (row, blocks, n)
        return row
