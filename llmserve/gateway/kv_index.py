"""Which KV blocks each replica holds, and where (GPU, CPU, DISK), from its KV events.

Each replica's batches are applied in sequence order. A batch ahead of the next expected one is
a gap: it is not applied, and `apply` says so, so the subscriber fills the gap from the replay
socket first. A batch behind it is a duplicate (already applied through a replay), unless it is
newer than the last one applied, which means the publisher restarted (its numbering starts
again at 0): the replica's blocks are forgotten (its cache was lost with it). `reset` forgets
them too, when a gap cannot be filled: what is known afterwards is a subset of what the replica
holds, never a block it dropped.

A stream is `live` while the index can vouch for it (synced, its publisher answering);
the router uses a replica's blocks only then. A prompt just routed to a replica has its blocks
`expect`ed there until its events tell (or a deadline passes), so the requests sharing a prefix
that arrive while the first one is still in prefill follow it.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field

from llmserve.gateway.kv_wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVBatch

GPU = "GPU"


class Applied(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seen before: ignored
    GAP = "gap"  # batches before it are missing: not applied


@dataclass
class ReplicaBlocks:
    """One replica's blocks: hash -> bit mask of the mediums holding it."""

    held: dict[BlockHash, int] = field(default_factory=dict)
    expected: dict[BlockHash, float] = field(default_factory=dict)  # hash -> until (monotonic): routed, not told
    counts: Counter = field(default_factory=Counter)  # medium -> blocks held there
    next_seq: int = 0  # the batch expected next
    last_ts: float = float("-inf")  # the last applied batch's time (a restarted publisher's are newer)
    block_size: int | None = None  # from its BlockStored events
    live: bool = False
    why_stale: str = "not synced yet"


@dataclass(frozen=True, slots=True)
class PrefixHit:
    blocks: int  # the prompt's leading blocks the replica holds, in any medium
    weighted: float  # the same, each block counted by the weight of its best medium


class KVIndex:
    """Replica URL -> its blocks. `tier_weights`: what a block cached in a medium is worth
    against recomputing it (a medium not named counts as the lowest weight named)."""

    def __init__(self, tier_weights: dict[str, float]):
        self.weights = dict(tier_weights)
        self.floor = min(self.weights.values(), default=0.0)
        self.bits: dict[str, int] = {}  # medium -> its bit
        self.bit_weights: list[float] = []  # by bit index
        self.replicas: dict[str, ReplicaBlocks] = {}

    def add(self, url: str) -> ReplicaBlocks:
        return self.replicas.setdefault(url, ReplicaBlocks())

    def _bit(self, medium: str | None) -> int:
        medium = medium or GPU
        bit = self.bits.get(medium)
        if bit is None:
            bit = self.bits[medium] = 1 << len(self.bit_weights)
            self.bit_weights.append(self.weights.get(medium, self.floor))
        return bit

    # -- events ---------------------------------------------------------------------------
    def apply(self, url: str, batch: KVBatch) -> Applied:
        r = self.replicas[url]
        if batch.seq < r.next_seq:
            if batch.ts <= r.last_ts:
                return Applied.DUPLICATE
            self.reset(url, 0)  # a restarted publisher: numbered from 0 again, its cache empty
        if batch.seq > r.next_seq:
            return Applied.GAP
        for event in batch.events:
            if isinstance(event, BlockStored):
                bit, medium = self._bit(event.medium), event.medium or GPU
                for h in event.block_hashes:
                    mask = r.held.get(h, 0)
                    r.expected.pop(h, None)
                    if not mask & bit:
                        r.held[h] = mask | bit
                        r.counts[medium] += 1
                if event.block_size > 0:
                    r.block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                bit, medium = self._bit(event.medium), event.medium or GPU
                for h in event.block_hashes:
                    mask = r.held.get(h, 0)
                    if mask & bit:
                        r.counts[medium] -= 1
                        if mask == bit:
                            del r.held[h]
                        else:
                            r.held[h] = mask & ~bit
            elif isinstance(event, AllBlocksCleared):
                r.held.clear()
                r.expected.clear()
                r.counts.clear()
        r.next_seq, r.last_ts = batch.seq + 1, max(r.last_ts, batch.ts)
        return Applied.APPLIED

    def reset(self, url: str, next_seq: int) -> None:
        """Forget the replica's blocks; batches are applied again from `next_seq`."""
        r = self.replicas[url]
        r.held.clear()
        r.expected.clear()
        r.counts.clear()
        r.next_seq, r.last_ts = next_seq, float("-inf")

    def expect(self, url: str, hashes: list[BlockHash], until: float) -> None:
        """A prompt was routed to the replica: its blocks count as held on its device until
        `until` (time.monotonic()) unless its events tell first."""
        r = self.replicas[url]
        if len(r.expected) > 65_536:  # (expired ones dropped now and then)
            now = time.monotonic()
            r.expected = {h: t for h, t in r.expected.items() if t > now}
        for h in hashes:
            if h not in r.held:
                r.expected[h] = until

    def set_live(self, url: str, live: bool, why: str = "") -> None:
        r = self.replicas[url]
        r.live, r.why_stale = live, "" if live else why

    def live(self, url: str) -> bool:
        r = self.replicas.get(url)
        return r is not None and r.live

    # -- lookups --------------------------------------------------------------------------
    def block_size(self, urls: list[str]) -> int | None:
        """The block size the replicas' events told (the first replica that told one)."""
        for url in urls:
            r = self.replicas.get(url)
            if r is not None and r.block_size:
                return r.block_size
        return None

    def prefix(self, url: str, hashes: list[BlockHash], now: float | None = None) -> PrefixHit:
        """How much of a prompt (its block hashes, first to last) the replica holds, or is
        expected to hold (as on its device)."""
        r = self.replicas[url]
        now = time.monotonic() if now is None else now
        weighted, n = 0.0, 0
        for h in hashes:
            mask = r.held.get(h, 0)
            if mask:
                weighted += max(w for i, w in enumerate(self.bit_weights) if mask >> i & 1)
            elif r.expected.get(h, 0.0) > now:
                weighted += self.weights.get(GPU, 1.0)
            else:
                break
            n += 1
        return PrefixHit(n, weighted)

    def snapshot(self) -> dict[str, dict]:
        """Per replica: live or why not, blocks per medium (for /health and the metrics)."""
        return {
            url: {"live": r.live, "blocks": dict(r.counts), "next_seq": r.next_seq}
            | ({} if r.live else {"why": r.why_stale})
            for url, r in self.replicas.items()
        }  # fmt: skip
