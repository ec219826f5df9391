"""The prefix cache's host-memory tier: blocks evicted from the device move here, by key, instead
of vanishing; a prefix hit here is loaded back into a device block instead of recomputed.

Bookkeeping only (which host block holds which key, least recently used first); the runner holds
the host memory and copies the blocks (`ModelRunner._tier_copy`), at the start of the step whose
allocations evicted them, before anything writes the device blocks again: offloads first, then
loads, so a block evicted and hit in one step reads what was just written. A host block that a
step loads from is pinned until the step's copies are taken, so no offload of that step overwrites it.

Swap preemption uses the same host memory: a preempted request's blocks are copied to host blocks
`reserve` takes out of the LRU (free ones first, then the least recently used cached blocks, which
move down to the disk tier if there is one), held until the request swaps back in (`release_after_step`:
free again once that step's copies are taken) or ends (`release`).
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
    swapped_out: int = 0  # blocks of preempted requests copied here
    swapped_in: int = 0  # and copied back to the device


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.entries: OrderedDict[BlockKey, int] = OrderedDict()  # key -> host block, least recent first
        self.pinned: set[int] = set()
        self.counts = HostTierCounts()
        self.dropped: list[BlockKey] = []  # keys evicted from the host tier, until taken (KV events)
        self.reserved: set[int] = set()  # host blocks holding swapped-out requests' blocks (outside the LRU)
        self._release_later: list[int] = []  # reserved blocks free again once the step's copies are taken

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
        """The step's copies are taken: its loads' blocks may be written again, and the blocks its
        swap-ins read are free."""
        self.pinned.clear()
        if self._release_later:
            self.release(self._release_later)
            self._release_later = []

    # -- swap preemption --------------------------------------------------------------------
    def reserve(self, n: int) -> list[tuple[int, BlockKey | None]] | None:
        """`n` host blocks for a swapped-out request, out of the LRU: free ones first, then those
        of the least recently used cached blocks not pinned by this step; each with the key it held
        (None: it was free). None, taking nothing, when fewer than `n` can be had."""
        if n > len(self.free) + sum(1 for b in self.entries.values() if b not in self.pinned):
            return None
        taken: list[tuple[int, BlockKey | None]] = []
        while len(taken) < n and self.free:
            taken.append((self.free.pop(), None))
        if len(taken) < n:
            victims = [k for k, b in self.entries.items() if b not in self.pinned][: n - len(taken)]
            taken.extend((self.entries.pop(k), k) for k in victims)
        self.reserved.update(b for b, _ in taken)
        self.counts.swapped_out += n
        return taken

    def release(self, blocks: list[int]) -> None:
        """Reserved blocks free again (their request ended while swapped out)."""
        for b in blocks:
            self.reserved.discard(b)
            self.free.append(b)

    def release_after_step(self, blocks: list[int]) -> None:
        """Reserved blocks a swap-in reads this step: free once the step's copies are taken (no
        offload of the same step may overwrite them first)."""
        self._release_later.extend(blocks)
        self.counts.swapped_in += len(blocks)

    @property
    def num_reserved(self) -> int:
        return len(self.reserved)

    def clear(self) -> None:
        """Forget every cached block (the counts stay; the reserved ones stay reserved)."""
        held = self.reserved
        self.free = [b for b in range(self.num_blocks - 1, -1, -1) if b not in held]
        self.entries.clear()
        self.pinned.clear()
