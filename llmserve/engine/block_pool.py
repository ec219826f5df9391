"""The pool of fixed-size KV blocks: reference counts, the free queue, the prefix-cache map.

A block with reference count 0 sits in the free queue, least recently used first. A
free block may still hold a cached prefix (it keeps its key); it is evicted only when
the pool hands it out again. Blocks that hold nothing reusable go to the front of the
queue, so cached blocks are the last to be reclaimed.
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
    __slots__ = ("block_id", "ref_cnt", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: BlockKey | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free queue, evicting cached ones."""
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_queue)} free")
        taken = []
        pop, blocks, cached = self.free_queue.popitem, self.blocks, self.cached  # one lookup each, not one a block
        for _ in range(count):
            block_id = pop(False)[0]
            block = blocks[block_id]
            key = block.key
            if key is not None:  # a block keeps a key only while it is the key's entry: one hash, not two
                owner = cached.pop(key, block_id)
                if owner != block_id:  # (defensive: never the case) someone else's entry stays
                    cached[key] = owner
                block.key = None
            block.ref_cnt = 1
            taken.append(block_id)
        return taken

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

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key)

    def register(self, block_id: int, key: BlockKey) -> None:
        """Record that a full, computed block holds `key` (first writer wins)."""
        if self.cached.setdefault(key, block_id) == block_id:  # (one hash of the key, not two)
            self.blocks[block_id].key = key

    def reset_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_used:
            return False
        self.cached.clear()
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
        del self.free_ids[len(self.free_ids) - count:]
        return taken[::-1]

    def free(self, block_ids: Iterable[int]) -> None:
        self.free_ids.extend(block_ids)
