"""The pool of fixed-size KV blocks: reference counts, the free queue, the prefix-cache map.

A block with reference count 0 sits in the free queue, least recently used first. A
free block may still hold a cached prefix (it keeps its key); it is evicted only when
the pool hands it out again. Blocks that hold nothing reusable go to the front of the
queue, so cached blocks are the last to be reclaimed.

A cached entry names its block and the block's generation (how many times the pool has
handed it out). Handing a block out again bumps the generation, which alone makes its old
entry stale: `lookup` and `register` treat a stale entry as absent, and `drop_evicted`
deletes the stale entries later, while a step runs (a fresh 7,680-token prompt evicts 480
cached blocks, whose keys' hashing had taken 0.3 ms before its first step, 2 CPU cores).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class BlockKey(NamedTuple):
    """Identifies a full block's contents: its parent's hash, its tokens, a salt.

    The dict lookup compares the tokens exactly, so a hash collision can never serve
    the wrong block. The salt separates caches that must not mix (for example the
    siblings of one n > 1 request when global prefix caching is off).
    """

    parent_hash: int | None
    token_ids: tuple[int, ...]
    salt: str | None


class BlockView:
    """One block's state, read from the pool's arrays (tests and debugging; the pool itself
    keeps no object per block)."""

    __slots__ = ("block_id", "_pool")

    def __init__(self, pool: BlockPool, block_id: int) -> None:
        self.block_id = block_id
        self._pool = pool

    @property
    def ref_cnt(self) -> int:
        return self._pool._ref[self.block_id]

    @property
    def key(self) -> BlockKey | None:
        return self._pool._key[self.block_id]

    @property
    def generation(self) -> int:
        return self._pool._gen[self.block_id]


class _Blocks(Sequence):
    """`pool.blocks[i]`: a view of block i (made on access)."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_blocks

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [BlockView(self._pool, b) for b in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return BlockView(self._pool, i % len(self))


class BlockPool:
    """Each block's reference count, key and generation are entries of three lists (no object per
    block: a pool of 1.4 million blocks took 4.5 s to build as objects). The free queue is three
    parts, front to back: blocks freed holding nothing (an OrderedDict whose end is the queue's
    front), the blocks never handed out (a range, taken from its start), and blocks freed holding a
    cached prefix or refreshed (an OrderedDict in queue order). Frees of blocks holding nothing go
    to the queue's front and the others to its back, so the three parts keep the single queue's
    order (tests/test_block_pool.py checks it against a plain list)."""

    def __init__(self, num_blocks: int, reserved: int = 0) -> None:
        """`reserved`: blocks 0 .. reserved - 1 are never handed out (a sliding window's freed
        entries point at block 0: kv_layout.NULL_BLOCK)."""
        if num_blocks < 1 + reserved:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.reserved = reserved
        self._ref = [1] * reserved + [0] * (num_blocks - reserved)  # (the reserved blocks held for good)
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._gen = [0] * num_blocks  # times handed out: a cached entry of an earlier one is stale
        self._front: OrderedDict[int, None] = OrderedDict()  # freed holding nothing; last = next out
        self._fresh = reserved  # blocks _fresh .. num_blocks - 1 never handed out (but `_fresh_out`)
        self._fresh_out: set[int] = set()  # of those, blocks taken out of turn (touch, refresh)
        self._back: OrderedDict[int, None] = OrderedDict()  # freed holding a prefix; first = next out
        self.cached: dict[BlockKey, tuple[int, int]] = {}  # key -> (block id, its generation then)
        self._evicted: list[BlockKey] = []  # keys whose entries went stale, until `drop_evicted`
        # with a host tier: (block, key) of each cached block handed out again, until taken
        self.record_evictions = False
        self.evictions: list[tuple[int, BlockKey]] = []

    @property
    def blocks(self) -> _Blocks:
        return _Blocks(self)

    @property
    def free_queue(self) -> list[int]:
        """The free blocks, in the order they are handed out (front first)."""
        fresh = [b for b in range(self._fresh, self.num_blocks) if b not in self._fresh_out]
        return list(reversed(self._front)) + fresh + list(self._back)

    @property
    def num_free(self) -> int:
        return len(self._front) + (self.num_blocks - self._fresh - len(self._fresh_out)) + len(self._back)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - self.reserved

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.reserved - self.num_free

    def is_free(self, block_id: int) -> bool:
        return self._ref[block_id] == 0

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free queue, evicting cached ones."""
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} blocks, {self.num_free} free")
        if len(self._evicted) > self.num_blocks:  # nobody called drop_evicted: keep the map bounded
            self.drop_evicted()
        taken: list[int] = []
        ref, gen, keys, evicted = self._ref, self._gen, self._key, self._evicted
        front, back = self._front, self._back
        while len(taken) < count:
            if front:  # freed holding nothing, last freed first
                block_id = front.popitem()[0]
            elif self._fresh < self.num_blocks and len(self._fresh_out) < self.num_blocks - self._fresh:
                self._take_fresh(count - len(taken), taken)
                continue
            else:  # freed holding a prefix, least recently used first
                block_id = back.popitem(False)[0]
            key = keys[block_id]
            if key is not None:  # its entry goes stale with the generation: no hash here
                evicted.append(key)
                if self.record_evictions:
                    self.evictions.append((block_id, key))
                keys[block_id] = None
            gen[block_id] += 1
            ref[block_id] = 1
            taken.append(block_id)
        return taken

    def _take_fresh(self, count: int, taken: list[int]) -> None:
        """Up to `count` blocks never handed out, in order, onto `taken`."""
        ref, gen, start = self._ref, self._gen, self._fresh
        if not self._fresh_out:
            stop = min(self.num_blocks, start + count)
            taken.extend(range(start, stop))
            ref[start:stop] = [1] * (stop - start)
            gen[start:stop] = [1] * (stop - start)  # (a block never handed out is at generation 0)
            self._fresh = stop
            return
        while count and self._fresh < self.num_blocks:
            block_id = self._fresh
            self._fresh += 1
            if block_id in self._fresh_out:
                self._fresh_out.discard(block_id)
                continue
            gen[block_id] += 1
            ref[block_id] = 1
            taken.append(block_id)
            count -= 1

    def _unqueue(self, block_id: int) -> None:
        """Take a free block out of the queue, wherever it is."""
        if block_id in self._back:
            del self._back[block_id]
        elif block_id in self._front:
            del self._front[block_id]
        else:  # never handed out: skipped when its turn comes
            self._fresh_out.add(block_id)

    def drop_evicted(self) -> None:
        """Delete the entries that evictions left stale (an entry made again since stays)."""
        cached, gen = self.cached, self._gen
        for key in self._evicted:
            entry = cached.get(key)
            if entry is not None and gen[entry[0]] != entry[1]:
                del cached[key]
        self._evicted = []

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each (cached) block, pulling free ones out of the queue."""
        ref = self._ref
        for block_id in block_ids:
            if ref[block_id] == 0:
                self._unqueue(block_id)
            ref[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each; blocks reaching zero join the free queue."""
        ref, keys, front, back = self._ref, self._key, self._front, self._back
        for block_id in block_ids:
            count = ref[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            ref[block_id] = count
            if count == 0:
                if keys[block_id] is None:
                    front[block_id] = None  # the queue's front: reclaimed first
                else:
                    back[block_id] = None

    def refresh(self, block_id: int) -> None:
        """A free block becomes the last to be evicted (a block in use: nothing)."""
        if self._ref[block_id] == 0:
            if block_id in self._back:
                self._back.move_to_end(block_id)
            else:
                self._unqueue(block_id)
                self._back[block_id] = None

    def lookup(self, key: BlockKey) -> int | None:
        entry = self.cached.get(key)
        if entry is None or self._gen[entry[0]] != entry[1]:
            return None
        return entry[0]

    def register(self, block_id: int, key: BlockKey) -> None:
        """Record that a full, computed block holds `key` (first writer wins, over a live entry)."""
        entry = (block_id, self._gen[block_id])
        held = self.cached.setdefault(key, entry)  # (one hash of the key, not two)
        if held is not entry:
            if self._gen[held[0]] == held[1]:
                return  # a live entry: the first writer keeps it
            self.cached[key] = entry  # a stale one: replaced
        self._key[block_id] = key

    def cached_free_blocks(self) -> list[tuple[int, BlockKey]]:
        """(block, key) of every free block holding a live cached prefix, least recently used first."""
        keys, cached, gen = self._key, self.cached, self._gen
        return [(b, k) for b in self._back if (k := keys[b]) is not None and cached.get(k) == (b, gen[b])]

    def reset_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_used:
            return False
        self.cached.clear()
        self._evicted = []
        self._key = [None] * self.num_blocks
        return True


class SwapPool:
    """CPU blocks that hold the KV of swapped-out requests: a plain free list."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, count: int) -> list[int]:
        taken = self.free_ids[-count:] if count else []
        del self.free_ids[len(self.free_ids) - count :]
        return taken[::-1]

    def free(self, block_ids: Iterable[int]) -> None:
        self.free_ids.extend(block_ids)
