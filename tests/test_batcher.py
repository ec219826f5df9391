"""serve/batcher.py: batched results equal the unbatched function's, request by request."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.serve.batcher import MicroBatcher

pytestmark = pytest.mark.unit


def square_all(items: list[int]) -> list[int]:
    return [x * x for x in items]


def test_concurrent_requests_share_batches_and_get_their_own_results():
    sizes: list[tuple[int, int]] = []

    async def run():
        b = MicroBatcher(square_all, max_items=8, max_wait_s=0.01, on_batch=lambda r, n: sizes.append((r, n)))
        requests = [list(range(i, i + (i % 3) + 1)) for i in range(20)]
        got = await asyncio.gather(*(b.submit(r) for r in requests))
        await b.close()
        return requests, got

    requests, got = asyncio.run(run())
    assert got == [square_all(r) for r in requests]
    assert sum(r for r, _ in sizes) == 20 and len(sizes) < 20
    assert all(n <= 8 for _, n in sizes)


def test_a_request_larger_than_a_batch_goes_in_slices_others_run_between():
    sizes = []

    async def run():
        b = MicroBatcher(square_all, max_items=4, on_batch=lambda r, n: sizes.append((r, n)))
        got = await asyncio.gather(b.submit(list(range(10))), b.submit([3]))
        await b.close()
        return got

    assert asyncio.run(run()) == [square_all(list(range(10))), [9]]
    assert sizes == [(1, 4), (1, 1), (1, 4), (1, 2)]  # the small request ran after the first slice


def test_a_big_request_whose_client_left_stops_between_slices():
    ran = []

    def record(items: list[int]) -> list[int]:
        ran.append(list(items))
        return items

    async def run():
        b = MicroBatcher(record, max_items=2, max_wait_s=0.0)
        calls = 0

        async def gone() -> bool:
            nonlocal calls
            calls += 1
            return calls >= 2  # the client leaves after the second slice

        with pytest.raises(asyncio.CancelledError):
            await b.submit(list(range(10)), gone)
        await b.close()

    asyncio.run(run())
    assert ran == [[0, 1], [2, 3]]  # 3 of 5 slices never ran


def test_a_failing_batch_fails_its_requests_and_the_next_batch_still_runs():
    def picky(items: list[int]) -> list[int]:
        if -1 in items:
            raise ValueError("bad item")
        return square_all(items)

    async def run():
        b = MicroBatcher(picky, max_items=2, max_wait_s=0.01)
        first = await asyncio.gather(b.submit([-1]), b.submit([2]), return_exceptions=True)
        later = await b.submit([5])
        await b.close()
        return first, later

    first, later = asyncio.run(run())
    assert isinstance(first[0], ValueError) and isinstance(first[1], ValueError)  # one batch
    assert later == [25]


def test_a_cancelled_request_is_skipped():
    seen: list[list[int]] = []

    def record(items: list[int]) -> list[int]:
        seen.append(list(items))
        return square_all(items)

    async def run():
        b = MicroBatcher(record, max_items=8, max_wait_s=0.05)
        gone = asyncio.create_task(b.submit([7]))
        await asyncio.sleep(0)
        gone.cancel()
        got = await b.submit([2])
        await b.close()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return got

    assert asyncio.run(run()) == [4]
    assert [7] not in seen and all(7 not in s for s in seen)


def test_close_fails_the_batch_in_flight_and_the_queued_ones():
    started = __import__("threading").Event()

    def slow(items: list[int]) -> list[int]:
        started.set()
        __import__("time").sleep(0.3)
        return square_all(items)

    async def run():
        b = MicroBatcher(slow, max_items=1, max_wait_s=0.0)
        running = asyncio.create_task(b.submit([1]))
        queued = asyncio.create_task(b.submit([2]))
        while not started.is_set():
            await asyncio.sleep(0.01)
        await b.close()
        return await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), 2)

    results = asyncio.run(run())
    assert all(isinstance(r, RuntimeError) and "shutting down" in str(r) for r in results), results
