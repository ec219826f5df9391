"""The prefix cache's disk tier, below the host tier: bookkeeping only (which slot holds which
block, least recently used first); the file is engine/kv_disk_store.py.

A block the host tier evicts moves down here instead of vanishing; a prefix found here is read
back (checked) when a request is admitted and loaded into a device block at the step's start.
Blocks are named by their chained digest (`kv_disk_store.chain_digest`), not by the device
cache's `BlockKey`, whose parent hash is Python's `hash` and changes from one process to the
next: a restarted engine finds its blocks by the same digests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmserve.engine.block_pool import BlockKey


@dataclass(slots=True)
class DiskEntry:
    slot: int
    key: BlockKey | None  # the device cache's key (None: a block found at start, of an earlier process)


@dataclass
class DiskTierCounts:
    stored: int = 0  # blocks given a slot (written in the background)
    loaded: int = 0  # blocks read back to the device
    dropped: int = 0  # blocks evicted from the disk tier, or missing when read


class DiskTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # digest -> entry, least recent first
        self.counts = DiskTierCounts()
        self.dropped: list[DiskEntry] = []  # entries evicted, until taken (KV events)

    def restore(self, digest: bytes, slot: int) -> None:
        """A block an earlier process wrote (call least recently written first)."""
        if digest in self.entries or not 0 <= slot < self.num_slots:
            return
        self.free.remove(slot)
        self.entries[digest] = DiskEntry(slot, None)

    def lookup(self, digest: bytes) -> int | None:
        """The slot holding `digest` (now the most recently used), or None."""
        entry = self.entries.get(digest)
        if entry is None:
            return None
        self.entries.move_to_end(digest)
        return entry.slot

    def store(self, digest: bytes, key: BlockKey) -> int | None:
        """A slot to write the block `digest` names (None: it is here already)."""
        entry = self.entries.get(digest)
        if entry is not None:
            self.entries.move_to_end(digest)
            entry.key = entry.key or key
            return None
        if self.free:
            slot = self.free.pop()
        else:
            _, victim = self.entries.popitem(last=False)
            slot = victim.slot
            self.dropped.append(victim)
            self.counts.dropped += 1
        self.entries[digest] = DiskEntry(slot, key)
        self.counts.stored += 1
        return slot

    def forget(self, digest: bytes) -> DiskEntry | None:
        """Drop a block whose slot did not hold it (torn, corrupt, a failed write or read)."""
        entry = self.entries.pop(digest, None)
        if entry is not None:
            self.free.append(entry.slot)
            self.counts.dropped += 1
        return entry

    def take_dropped(self) -> list[DiskEntry]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def clear(self) -> None:
        """Forget every block (the counts stay)."""
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.entries.clear()
        self.dropped = []
