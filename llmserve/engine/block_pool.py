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
from collections.abc import Iterable
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


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "key", "generation")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: BlockKey | None = None
        self.generation = 0  # times handed out: a cached entry of an earlier one is stale


class BlockPool:
    def __init__(self, num_blocks: int, reserved: int = 0) -> None:
        """`reserved`: blocks 0 .. reserved - 1 are never handed out (a sliding window's freed
        entries point at block 0: kv_layout.NULL_BLOCK)."""
        if num_blocks < 1 + reserved:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.reserved = reserved
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        for block in self.blocks[:reserved]:
            block.ref_cnt = 1  # held for good
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(reserved, num_blocks))
        self.cached: dict[BlockKey, tuple[int, int]] = {}  # key -> (block id, its generation then)
        self._evicted: list[BlockKey] = []  # keys whose entries went stale, until `drop_evicted`
        # with a host tier: (block, key) of each cached block handed out again, until taken
        self.record_evictions = False
        self.evictions: list[tuple[int, BlockKey]] = []

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - self.reserved

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.reserved - len(self.free_queue)

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free queue, evicting cached ones."""
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_queue)} free")
        if len(self._evicted) > self.num_blocks:  # nobody called drop_evicted: keep the map bounded
            self.drop_evicted()
        taken = []
        pop, blocks, evicted = self.free_queue.popitem, self.blocks, self._evicted  # one lookup each, not one a block
        for _ in range(count):
            block_id = pop(False)[0]
            block = blocks[block_id]
            if block.key is not None:  # its entry goes stale with the generation: no hash here
                evicted.append(block.key)
                if self.record_evictions:
                    self.evictions.append((block_id, block.key))
                block.key = None
            block.generation += 1
            block.ref_cnt = 1
            taken.append(block_id)
        return taken

    def drop_evicted(self) -> None:
        """Delete the entries that evictions left stale (an entry made again since stays)."""
        cached, blocks = self.cached, self.blocks
        for key in self._evicted:
            entry = cached.get(key)
            if entry is not None and blocks[entry[0]].generation != entry[1]:
                del cached[key]
        self._evicted = []

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each (cached) block, pulling free ones out of the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each; blocks reaching zero join the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                if block.key is None:
                    self.free_queue.move_to_end(block_id, last=False)

    def refresh(self, block_id: int) -> None:
        """A free block becomes the last to be evicted (a block in use: nothing)."""
        if self.blocks[block_id].ref_cnt == 0:
            self.free_queue.move_to_end(block_id)

    def lookup(self, key: BlockKey) -> int | None:
        entry = self.cached.get(key)
        if entry is None or self.blocks[entry[0]].generation != entry[1]:
            return None
        return entry[0]

    def register(self, block_id: int, key: BlockKey) -> None:
        """Record that a full, computed block holds `key` (first writer wins, over a live entry)."""
        block = self.blocks[block_id]
        entry = (block_id, block.generation)
        held = self.cached.setdefault(key, entry)  # (one hash of the key, not two)
        if held is not entry:
            if self.blocks[held[0]].generation == held[1]:
                return  # a live entry: the first writer keeps it
            self.cached[key] = entry  # a stale one: replaced
        block.key = key

    def reset_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_used:
            return False
        self.cached.clear()
        self._evicted = []
        for block in self.blocks:
            block.key = None
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
