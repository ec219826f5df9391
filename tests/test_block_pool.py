"""Block pool: reference counts, LRU free queue, prefix-cache map."""

from __future__ import annotations

import pytest

from llmserve.engine.block_pool import BlockKey, BlockPool, SwapPool

pytestmark = pytest.mark.unit


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


def test_an_evicted_blocks_entry_is_stale_at_once_and_dropped_later():
    """Handing a cached block out again makes its entry stale without touching the map
    (lookup misses, a new writer takes the key); `drop_evicted` deletes only stale entries:
    one made again since (by the same block or another) stays. A block that lost the key to
    a first writer holds none, so its eviction leaves the winner's entry."""
    pool = BlockPool(4)
    b1, b2, b3, b4 = pool.allocate(4)
    pool.register(b1, key(1))
    pool.register(b2, key(1))  # lost: b2 keeps no key
    pool.register(b3, key(3))
    pool.register(b4, key(4))
    pool.free([b2])
    assert pool.allocate(1) == [b2] and pool.lookup(key(1)) == b1
    pool.free([b3, b4, b1])
    assert pool.allocate(3) == [b3, b4, b1]  # all three entries stale now
    assert [pool.lookup(key(n)) for n in (1, 3, 4)] == [None, None, None]
    pool.register(b3, key(3))  # the same block holds it again
    pool.register(b2, key(4))  # another block does
    assert len(pool.cached) == 3
    pool.drop_evicted()
    assert pool.cached == {key(3): (b3, 2), key(4): (b2, 2)}  # (each block handed out twice)
    assert pool.lookup(key(3)) == b3 and pool.lookup(key(4)) == b2 and pool.lookup(key(1)) is None


def test_stale_entries_stay_bounded_without_drop_evicted():
    pool = BlockPool(8)
    for n in range(100):
        (b,) = pool.allocate(1)
        pool.register(b, key(n))
        pool.free([b])
        pool.allocate(8)  # evicts it
        pool.free(list(range(8)))
    assert len(pool.cached) <= 2 * pool.num_blocks + 1 and len(pool._evicted) <= pool.num_blocks + 8


class ReferencePool:
    """The prefix map kept exact at every step: an eviction deletes the evicted block's entry."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.key: list[BlockKey | None] = [None] * num_blocks
        self.queue = list(range(num_blocks))  # front: reclaimed first
        self.cached: dict[BlockKey, int] = {}

    def allocate(self, count: int) -> list[int]:
        taken, self.queue = self.queue[:count], self.queue[count:]
        for b in taken:
            if self.key[b] is not None:
                del self.cached[self.key[b]]
                self.key[b] = None
            self.ref[b] = 1
        return taken

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.queue.insert(0, b) if self.key[b] is None else self.queue.append(b)

    def register(self, b: int, k: BlockKey) -> None:
        if k not in self.cached:
            self.cached[k] = b
            self.key[b] = k

    def lookup(self, k: BlockKey) -> int | None:
        return self.cached.get(k)


def test_the_pool_matches_the_reference_over_random_operations():
    """Allocations, frees, hits (touch), registrations over few distinct keys, and
    `drop_evicted` at random moments: every lookup, the free queue and every block's key
    and count equal the eagerly evicting reference's."""
    import random

    for seed in range(20):
        rng = random.Random(seed)
        pool, ref = BlockPool(12), ReferencePool(12)
        held: list[int] = []
        for _ in range(400):
            op = rng.random()
            if op < 0.3 and pool.num_free:
                count = rng.randint(1, min(4, pool.num_free))
                got = pool.allocate(count)
                assert got == ref.allocate(count)
                held += got
            elif op < 0.5 and held:
                b = held.pop(rng.randrange(len(held)))
                pool.free([b]), ref.free([b])
            elif op < 0.7 and held:
                b, k = rng.choice(held), key(rng.randrange(10))
                if pool.blocks[b].key is None:  # a block is registered once, when it fills
                    pool.register(b, k), ref.register(b, k)
            elif op < 0.85:
                k = key(rng.randrange(10))
                hit = pool.lookup(k)
                assert hit == ref.lookup(k)
                if hit is not None:
                    pool.touch([hit]), ref.touch([hit])
                    held.append(hit)
            else:
                pool.drop_evicted()
            assert list(pool.free_queue) == ref.queue
            assert [(b.ref_cnt, b.key) for b in pool.blocks] == list(zip(ref.ref, ref.key))
        assert {k: pool.lookup(k) for k in map(key, range(10))} == {k: ref.lookup(k) for k in map(key, range(10))}
        pool.drop_evicted()
        assert {k: e[0] for k, e in pool.cached.items()} == ref.cached


def test_over_allocation_raises():
    with pytest.raises(RuntimeError):
        BlockPool(2).allocate(3)


def test_swap_pool():
    pool = SwapPool(3)
    got = pool.allocate(2)
    assert len(set(got)) == 2 and pool.num_free == 1
    pool.free(got)
    assert pool.num_free == 3


def test_a_pool_of_two_million_blocks_builds_in_well_under_a_second():
    """No object per block (a pool of 1.4 million blocks took 4.5 s as objects): the counts, keys
    and generations are lists, the blocks never handed out a range."""
    import time

    start = time.perf_counter()
    pool = BlockPool(2_000_000, reserved=1)
    built = time.perf_counter() - start
    assert built < 0.5, f"{built:.3f} s"
    assert pool.num_free == 1_999_999 and pool.num_used == 0
    assert pool.allocate(3) == [1, 2, 3] and pool.num_free == 1_999_996
    pool.free([2])
    assert pool.allocate(2) == [2, 4]  # a freed block holding nothing goes first, then the untouched ones


def test_refresh_and_touch_of_blocks_never_handed_out_keep_the_queue_order():
    """A block taken out of the untouched range out of turn (refresh, touch) is skipped there."""
    pool = BlockPool(6)
    pool.refresh(2)  # free, untouched: to the back of the queue
    assert pool.free_queue == [0, 1, 3, 4, 5, 2]
    pool.touch([4])
    assert pool.free_queue == [0, 1, 3, 5, 2] and pool.num_free == 5
    assert pool.allocate(4) == [0, 1, 3, 5]
    pool.free([4])
    assert pool.free_queue == [4, 2] and pool.blocks[4].generation == 0
