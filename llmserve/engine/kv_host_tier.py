"""The prefix cache's host-memory tier: blocks evicted from the device move here, by key, instead
of vanishing; a prefix hit here is loaded back into a device block instead of recomputed.

Bookkeeping only (which host block holds which key, least recently used first); the runner holds
the host memory and copies the blocks (`ModelRunner._tier_copy`), at the start of the step whose
allocations evicted them, before anything writes the device blocks again: offloads first, then
loads, so a block evicted and hit in one step reads what was just written. A host block that a
step loads from is pinned until the step's copies are taken, so no offload of that step overwrites it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmserve.engine.block_pool import BlockKey


@dataclass
class HostTierCounts:
    stored: int = 0  # blocks written to the host tier
    loaded: int = 0  # blocks read back to the device
    dropped: int = 0  # evicted blocks not kept (every host block pinned by this step's loads)


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.entries: OrderedDict[BlockKey, int] = OrderedDict()  # key -> host block, least recent first
        self.pinned: set[int] = set()
        self.counts = HostTierCounts()
        self.dropped: list[BlockKey] = []  # keys evicted from the host tier, until taken (KV events)

    def lookup(self, key: BlockKey) -> int | None:
        """The host block holding `key` (now the most recently used), or None."""
        block = self.entries.get(key)
        if block is not None:
            self.entries.move_to_end(key)
        return block

    def store(self, key: BlockKey) -> int | None:
        """A host block for an evicted device block's `key` (None: none to write: it is here
        already, or every host block is pinned)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return None
        if self.free:
            block = self.free.pop()
        else:
            victim = next((k for k, b in self.entries.items() if b not in self.pinned), None)
            if victim is None:
                self.counts.dropped += 1
                return None
            block = self.entries.pop(victim)
            self.dropped.append(victim)
        self.entries[key] = block
        self.counts.stored += 1
        return block

    def take_dropped(self) -> list[BlockKey]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def pin(self, block: int) -> None:
        self.pinned.add(block)
        self.counts.loaded += 1

    def unpin_all(self) -> None:
        self.pinned.clear()

    def clear(self) -> None:
        """Forget every block (the counts stay)."""
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.entries.clear()
        self.pinned.clear()
