"""Block pool: reference counts, LRU free queue, prefix-cache map."""

from __future__ import annotations

import pytest

from llmserve.engine.block_pool import BlockKey, BlockPool, SwapPool


def key(n: int) -> BlockKey:
    return BlockKey(None, (n,), None)


def test_allocate_touch_free_refcounts():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.num_free == 2
    pool.touch([a])  # shared by a second request
    pool.free([a])
    assert not pool.is_free(a) and pool.num_free == 2
    pool.free([a, b])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.free([a])


def test_cached_free_blocks_are_evicted_last_and_in_lru_order():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.register(blocks[0], key(0))
    pool.register(blocks[1], key(1))
    pool.free([blocks[1]])  # cached, freed first: least recently used of the cached
    pool.free([blocks[0]])  # cached
    pool.free([blocks[2], blocks[3]])  # hold nothing: reclaimed before any cached block
    taken = pool.allocate(3)
    assert set(taken[:2]) == {blocks[2], blocks[3]}
    assert taken[2] == blocks[1]  # the LRU cached block goes first
    assert pool.lookup(key(1)) is None  # evicted
    assert pool.lookup(key(0)) == blocks[0]  # still cached


def test_touch_revives_cached_free_block():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.register(b, key(7))
    pool.free([b])
    assert pool.num_free == 2 and pool.lookup(key(7)) == b
    pool.touch([b])
    assert pool.num_free == 1 and pool.blocks[b].ref_cnt == 1


def test_first_writer_wins_and_reset():
    pool = BlockPool(3)
    b1, b2 = pool.allocate(2)
    pool.register(b1, key(1))
    pool.register(b2, key(1))
    assert pool.lookup(key(1)) == b1
    assert not pool.reset_cache()  # blocks in use
    pool.free([b1, b2])
    assert pool.reset_cache() and pool.lookup(key(1)) is None


def test_evicting_a_block_drops_only_its_own_entry():
    """A block that a later writer lost to (first writer wins) holds no key, so its eviction
    leaves the winner's entry; the winner's eviction drops it. A block whose key maps to
    another block (never made by the pool itself) leaves that entry too."""
    pool = BlockPool(3)
    b1, b2, b3 = pool.allocate(3)
    pool.register(b1, key(1))
    pool.register(b2, key(1))  # lost: b2 keeps no key
    pool.free([b2])
    assert pool.allocate(1) == [b2] and pool.lookup(key(1)) == b1
    pool.blocks[b3].key = key(1)  # an inconsistent key: b1 is the entry
    pool.free([b3])
    assert pool.allocate(1) == [b3] and pool.lookup(key(1)) == b1
    assert pool.blocks[b3].key is None
    pool.free([b1])
    assert pool.allocate(1) == [b1] and pool.lookup(key(1)) is None


def test_over_allocation_raises():
    with pytest.raises(RuntimeError):
        BlockPool(2).allocate(3)


def test_swap_pool():
    pool = SwapPool(3)
    got = pool.allocate(2)
    assert len(set(got)) == 2 and pool.num_free == 1
    pool.free(got)
    assert pool.num_free == 3
