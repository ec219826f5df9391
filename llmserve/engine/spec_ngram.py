"""The n-gram proposer of speculative decoding (prompt lookup): a sequence whose last n tokens
occurred earlier in it proposes the tokens that followed that occurrence.

For n from `most` down to `least`, the latest earlier occurrence of the last n tokens wins (the
longest n first); its next up to K tokens are the proposal. `propose` does the whole batch at
once with numpy (the sequences as rows of one matrix, every window compared at once);
`propose_reference` is the plain loop it is tested against. Each request's tokens are kept as a
numpy array that grows with its new tokens (`TokenArrays`), not converted again every step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

PAD = -1  # no token


def propose_reference(tokens: list[int], k: int, least: int, most: int) -> list[int]:
    """The proposal for one sequence: the (up to) k tokens after the latest earlier occurrence of
    its longest matching suffix of `least` to `most` tokens; [] when none occurs."""
    length = len(tokens)
    for n in range(min(most, length - 1), least - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # occurrences that end before the suffix's last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(arrays: list[np.ndarray], ks: list[int], least: int, most: int) -> list[list[int]]:
    """`propose_reference` for every sequence at once: `arrays` the sequences (int64), `ks` the
    most tokens each may take."""
    if not arrays:
        return []
    lengths = np.array([len(a) for a in arrays])
    width = int(lengths.max())
    rows = len(arrays)
    seqs = np.full((rows, width + most), PAD, dtype=np.int64)  # (room past the end: proposals read there)
    for i, a in enumerate(arrays):
        seqs[i, : len(a)] = a
    found = np.full(rows, -1)  # where each row's proposal starts (-1: none yet)
    row_index = np.arange(rows)
    for n in range(most, least - 1, -1):
        open_rows = (found < 0) & (lengths > n)
        if not open_rows.any() or width < n + 1:
            continue
        suffix = seqs[row_index[:, None], (lengths - n)[:, None] + np.arange(n)]  # [rows, n]
        windows = sliding_window_view(seqs[:, :width], n, axis=1)  # [rows, width - n + 1, n]
        hits = (windows == suffix[:, None, :]).all(axis=2)
        starts = np.arange(hits.shape[1])
        hits &= starts[None, :] <= (lengths - n - 1)[:, None]  # ends before the suffix's last token
        latest = hits.shape[1] - 1 - np.argmax(hits[:, ::-1], axis=1)
        matched = open_rows & hits.any(axis=1)
        found = np.where(matched, latest + n, found)
    out = []
    for i in range(rows):
        if found[i] < 0 or ks[i] <= 0:
            out.append([])
            continue
        end = min(found[i] + ks[i], lengths[i])
        out.append(seqs[i, found[i] : end].tolist())
    return out


class TokenArrays:
    """Each request's tokens as a numpy array, extended with what is new since the last call."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # id -> (buffer, tokens in it)

    def of(self, request_id: str, tokens: list[int]) -> np.ndarray:
        buffer, used = self._arrays.get(request_id, (None, 0))
        n = len(tokens)
        if buffer is None or used > n:
            buffer, used = np.empty(max(64, 2 * n), dtype=np.int64), 0
        elif n > len(buffer):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:used] = buffer[:used]
            buffer = grown
        if n > used:
            buffer[used:n] = tokens[used:n]
        self._arrays[request_id] = (buffer, n)
        return buffer[:n]

    def forget(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)
