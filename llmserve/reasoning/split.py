"""What every reasoning parser returns, and the hold-back of a half-written marker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Split:
    """One cut of an output: the reasoning (so far), and the content (None: not begun)."""

    reasoning: str
    content: str | None


def held(text: str, marker: str) -> int:
    """The length of the longest end of `text` that a `marker` could still grow from."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0
