"""Block tables of the running requests as rows of one array, kept between steps.

A request's block list only grows while it runs, so each step copies just its new
block ids. A request whose list object changed (preempted and re-admitted, swapped
back in) is copied afresh; rows of requests not scheduled in a step are released.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableBuffer:
    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.max_blocks = max_blocks
        self._rows: dict[str, tuple[int, list[int], int]] = {}  # id -> (row, list, copied)
        self._free = list(range(max_rows - 1, -1, -1))

    def rows_for(self, requests: list[tuple[str, list[int]]]) -> np.ndarray:
        """Row index of each (request id, block list), in order, after syncing the rows."""
        return self.rows_of([rid for rid, _ in requests], [blocks for _, blocks in requests])

    def rows_of(self, ids: Sequence[str], tables: Sequence[list[int]]) -> np.ndarray:
        """`rows_for` over the ids and the block lists apart: a row whose list is the same object
        at the same length as last time (a running request between its blocks) is looked up only."""
        rows = self._rows
        if len(rows) > len(ids) or not rows.keys() <= set(ids):
            for rid in rows.keys() - set(ids):
                self._free.append(rows.pop(rid)[0])
        out = []
        append, get = out.append, rows.get
        for rid, blocks in zip(ids, tables):  # (every running request every step: kept lean)
            entry = get(rid)
            if entry is not None and entry[1] is blocks and entry[2] == len(blocks):
                append(entry[0])
            else:
                append(self._sync(rid, blocks))
        return np.array(out, dtype=np.int64)

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
