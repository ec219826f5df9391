"""The gateway's KV index (gateway/kv_index.py, kv_wire.py, kv_subscriber.py, kv_routing.py), in
process: events applied in sequence per medium, gaps, restarts, garbled messages; a subscriber
on the engine's real publisher (engine/kv_events.py) filling a gap from the replay socket and
going stale when the publisher stops answering; the choice between replicas."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from dataclasses import dataclass

import pytest
import zmq
import zmq.asyncio

from llmserve.config import KVEventsConfig
from llmserve.engine.kv_events import KVEventPublisher, packb
from llmserve.engine.kv_events import block_hashes as engine_block_hashes
from llmserve.gateway.config import GatewayConfig, KVEventsSource, KVRoutingConfig
from llmserve.gateway.kv_index import Applied, KVIndex
from llmserve.gateway.kv_prompt import KVPrompt, completion_ids
from llmserve.gateway.kv_routing import KVRouting
from llmserve.gateway.kv_subscriber import KVStream
from llmserve.gateway.kv_wire import BadMessage, BlockStored, KVBatch, decode_payload, decode_published
from llmserve.kv_block_hash import block_hashes

pytestmark = pytest.mark.unit

URL = "http://r1"
WEIGHTS = {"GPU": 1.0, "CPU": 0.5, "DISK": 0.25}


def batch(seq, *events, ts=None):
    return decode_payload(seq, packb([float(seq) if ts is None else ts, list(events)]))


def stored_event(hashes, medium="GPU", block_size=4):
    return ["BlockStored", list(hashes), None, [1] * (block_size * len(hashes)), block_size, None, medium]


def index_with(url=URL) -> KVIndex:
    index = KVIndex(WEIGHTS)
    index.add(url)
    return index


def test_the_gateway_hashes_are_the_engine_s():
    rng = random.Random(0)
    for n in (0, 3, 16, 17, 100):
        ids = [rng.randrange(50_000) for _ in range(n)]
        assert block_hashes(ids, 16) == engine_block_hashes(ids, 16)
        assert block_hashes(ids, 8, "lora:x:1") == engine_block_hashes(ids, 8, "lora:x:1")
        assert n < 8 or block_hashes(ids, 8, "lora:x:1") != block_hashes(ids, 8)
    assert len(block_hashes(list(range(33)), 16)) == 2


def test_stored_removed_and_cleared_per_medium():
    index = index_with()
    assert index.apply(URL, batch(0, stored_event([1, 2, 3]), stored_event([2, 3], "CPU"))) is Applied.APPLIED
    assert index.prefix(URL, [1, 2, 3, 4]).blocks == 3
    assert index.prefix(URL, [1, 2, 3]).weighted == 3.0  # the best medium counts
    index.apply(URL, batch(1, ["BlockRemoved", [2, 3], "GPU"]))
    assert index.prefix(URL, [1, 2, 3]).weighted == 2.0  # 1 on GPU, then 2 and 3 on CPU
    assert index.replicas[URL].counts == {"GPU": 1, "CPU": 2}
    index.apply(URL, batch(2, ["BlockRemoved", [2], "CPU"], stored_event([9], "DISK")))
    assert index.prefix(URL, [1, 2, 3]).blocks == 1  # the prefix stops at the first missing block
    assert index.prefix(URL, [9]).weighted == 0.25
    assert index.prefix(URL, [2, 3]).blocks == 0
    index.apply(URL, batch(3, ["AllBlocksCleared"]))
    assert index.prefix(URL, [1]).blocks == 0 and sum(index.replicas[URL].counts.values()) == 0
    assert index.replicas[URL].block_size == 4 and index.replicas[URL].next_seq == 4


def test_a_removal_of_a_block_never_stored_is_harmless():
    index = index_with()
    index.apply(URL, batch(0, ["BlockRemoved", [5], "GPU"], stored_event([6]), stored_event([6])))
    assert index.replicas[URL].counts == {"GPU": 1} and index.prefix(URL, [6]).blocks == 1


def test_gaps_duplicates_and_a_restarted_publisher():
    index = index_with()
    index.apply(URL, batch(0, stored_event([1])))
    assert index.apply(URL, batch(2, stored_event([3]))) is Applied.GAP  # 1 is missing: not applied
    assert index.prefix(URL, [3]).blocks == 0 and index.replicas[URL].next_seq == 1
    assert index.apply(URL, batch(1, stored_event([2]))) is Applied.APPLIED  # the replay fills it
    assert index.apply(URL, batch(2, stored_event([3]))) is Applied.APPLIED
    assert index.apply(URL, batch(1, stored_event([7]))) is Applied.DUPLICATE  # seen already (replayed)
    assert index.prefix(URL, [7]).blocks == 0 and index.prefix(URL, [1]).blocks == 1
    # a batch numbered 0 again, newer than the last: the publisher restarted, its cache empty
    assert index.apply(URL, batch(0, stored_event([8]), ts=100.0)) is Applied.APPLIED
    assert index.prefix(URL, [1]).blocks == 0 and index.prefix(URL, [8]).blocks == 1
    index.reset(URL, 40)  # a gap that cannot be filled: forget, go on from there
    assert index.prefix(URL, [8]).blocks == 0 and index.apply(URL, batch(40, stored_event([4]))) is Applied.APPLIED


@pytest.mark.parametrize(
    "frames, why",
    [
        ([b"kv", b"\x00" * 8], "3 frames"),
        ([b"other", b"\x00" * 8, packb([0.0, []])], "topic"),
        ([b"kv", b"\x00" * 3, packb([0.0, []])], "8 bytes"),
        ([b"kv", b"\x00" * 8, b"\xc1\xc1"], "not a KV event batch"),
        ([b"kv", b"\x00" * 8, packb("text")], "not a KV event batch"),
        ([b"kv", b"\x00" * 8, packb([0.0, [["BlockStored", "not a list"]]])], "malformed event"),
        ([b"kv", b"\x00" * 8, packb([0.0, [[7, 8]]])], "malformed event"),
        ([b"kv", b"\x00" * 8, packb([0.0, [["BlockRemoved", [1.5]]]])], "malformed event"),
    ],  # fmt: skip
)
def test_garbled_messages_are_bad_messages(frames, why):
    with pytest.raises(BadMessage, match=why):
        decode_published(frames, b"kv")


def test_an_unknown_event_type_is_skipped_and_vllm_s_extra_fields_read():
    got = decode_payload(
        3, packb([1.0, [["BlockPinned", [1]], stored_event([5]) + ["extra", 1], ["AllBlocksCleared"]]])
    )
    assert got.skipped == 1 and len(got.events) == 2 and got.events[0].block_hashes == [5]
    assert decode_payload(0, packb([1.0, [["BlockStored", [5]]]])).events[0].medium is None  # None: GPU


@dataclass
class R:
    url: str
    outstanding: int = 0


def routing(load_weight=256.0, block_size=4, expect_s=0.0) -> KVRouting:
    config = GatewayConfig.model_validate({"models": {"m": {
        "replicas": ["http://a", "http://b", "http://c"], "routing": "kv_aware",
        "kv_events": {"replicas": {u: {"endpoint": "tcp://127.0.0.1:1"} for u in ("http://a", "http://b")},
                      "tier_weights": WEIGHTS, "load_weight_tokens": load_weight, "block_size": block_size,
                      "expect_s": expect_s}}}})  # fmt: skip
    return KVRouting(config)


def test_the_choice_weighs_the_cached_prefix_by_medium_against_load():
    kv = routing(load_weight=2.0)
    prompt = KVPrompt(list(range(40)))  # 10 blocks of 4
    hashes = prompt.hashes(4)
    index = kv.indexes["m"]
    index.apply("http://a", batch(0, stored_event(hashes[:3])))  # 12 tokens on GPU
    index.apply("http://b", batch(0, stored_event(hashes[:8], "CPU")))  # 32 tokens on CPU: worth 16
    a, b, c = R("http://a"), R("http://b"), R("http://c")
    assert kv.choose("m", [a, b, c], prompt, 4, 0) is None  # no stream live yet: route by load
    index.set_live("http://a", True)
    index.set_live("http://b", True)
    choice = kv.choose("m", [a, b, c], prompt, 4, 0)
    assert choice.replica is b and choice.decision == "kv_prefix" and choice.cached_tokens == 16.0
    b.outstanding = 3  # 16 - 3 x 2 = 10 < 12
    assert kv.choose("m", [a, b, c], prompt, 4, 0).replica is a
    b.outstanding, a.outstanding = 0, 1
    assert kv.choose("m", [a, b, c], KVPrompt([99] * 8), 4, 0).decision == "kv_load"  # nobody holds it
    assert kv.choose("m", [a, b, c], KVPrompt([99] * 8), 4, 0).replica in (b, c)  # the least busy
    index.set_live("http://b", False, "gone")  # a stale stream counts as holding nothing
    assert kv.choose("m", [a, b, c], prompt, 4, 0).replica is a
    a.outstanding = 6  # past affinity_max_imbalance over the least busy: not a candidate
    assert kv.choose("m", [a, b, c], prompt, 4, 0) is None
    assert kv.choose("m", [a, b, c], None, 4, 0) is None  # no prompt to go by
    assert kv.indexes["m"].replicas["http://c"].why_stale == "no kv_events endpoint configured"


def test_a_prompt_routed_is_expected_on_its_replica_until_its_events_tell():
    """Requests sharing a prefix that arrive while the first is in prefill follow it."""
    kv = routing(load_weight=10.0, expect_s=30.0)
    index = kv.indexes["m"]
    for url in ("http://a", "http://b"):
        index.set_live(url, True)
    a, b = R("http://a"), R("http://b", outstanding=1)
    shared = KVPrompt(list(range(40)))
    first = kv.choose("m", [a, b], shared, 4, 0)
    assert first.replica is a and first.decision == "kv_load"
    a.outstanding = 2  # it is busy with that one (and another), yet holds (will hold) the prefix
    follower = kv.choose("m", [a, b], KVPrompt(list(range(40)) + [7] * 8), 4, 1)
    assert follower.replica is a and follower.decision == "kv_prefix" and follower.cached_tokens == 40
    assert index.prefix("http://a", shared.hashes(4), now=1e12).blocks == 0  # the expectation ends
    index.apply("http://a", batch(0, stored_event(shared.hashes(4)[:5], "CPU")))  # told: where it is
    assert index.prefix("http://a", shared.hashes(4)).weighted == 5 * 0.5 + 5 * 1.0
    index.apply("http://a", batch(1, ["AllBlocksCleared"]))
    assert index.prefix("http://a", shared.hashes(4)).blocks == 0


def test_completion_prompts_as_ids_text_and_batches():
    assert completion_ids({"prompt": [5, 6, 7]}, None) == [5, 6, 7]
    assert completion_ids({"prompt": [[5, 6], [7]]}, None) == [5, 6]
    assert completion_ids({"prompt": "hello"}, None) is None  # text needs the tokenizer
    assert completion_ids({"prompt": [5, "x"]}, None) is None and completion_ids({"prompt": 3}, None) is None
    assert completion_ids({"prompt": [True, 2]}, None) is None


@pytest.mark.parametrize(
    "route, message",
    [
        ({"routing": "kv_aware"}, "needs kv_events"),
        ({"routing": "kv_aware", "kv_events": {"replicas": {"http://z": {"endpoint": "tcp://h:1"}}}}, "does not have"),
        ({"routing": "kv_aware", "kv_events": {"replicas": {"http://a": {"endpoint": "tcp://*:1"}}}}, "bind pattern"),
        (
            {
                "routing": "kv_aware",
                "kv_events": {"replicas": {"http://a": {"endpoint": "tcp://h:1"}}, "tier_weights": {"GPU": 2}},
            },
            "tier_weights",
        ),
    ],  # fmt: skip
)
def test_bad_kv_aware_configs_are_refused(route, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig.model_validate({"models": {"m": {"replicas": ["http://a/"], **route}}})


# -- a subscriber on the engine's own publisher ------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publisher(replay: bool = True) -> tuple[KVEventPublisher, KVEventsSource]:
    pub, rep = _port(), _port()
    publisher = KVEventPublisher(KVEventsConfig(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}", "kv"))
    return publisher, KVEventsSource(endpoint=f"tcp://127.0.0.1:{pub}",
                                      replay_endpoint=f"tcp://127.0.0.1:{rep}" if replay else None, topic="kv")  # fmt: skip


async def _until(check, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


SETTINGS = KVRoutingConfig(replicas={URL: KVEventsSource(endpoint="tcp://x:1")}, probe_interval_s=0.2,
                           probe_timeout_s=0.5)  # fmt: skip


def test_a_late_subscriber_fills_the_gap_from_the_replay_socket_and_goes_stale_when_it_stops():
    """Batches published before the gateway subscribed come from the replay socket; later ones
    from the PUB socket; a publisher that stops answering makes the stream stale."""

    async def main():
        publisher, source = _publisher()
        index = KVIndex(WEIGHTS)
        context = zmq.asyncio.Context()
        try:
            for i in range(5):  # before anyone listens
                publisher.publish([stored_event([i])])
            stream = KVStream(URL, source, index, SETTINGS, context)
            task = asyncio.create_task(stream.run())
            await _until(lambda: index.live(URL) and index.replicas[URL].next_seq == 5)
            assert index.prefix(URL, [0]).blocks == 1 and index.replicas[URL].counts == {"GPU": 5}
            await asyncio.sleep(0.3)  # (the subscription reaches the publisher)
            publisher.publish([stored_event([10]), ["BlockRemoved", [0], "GPU"]])
            await _until(lambda: index.replicas[URL].next_seq == 6)
            assert index.prefix(URL, [10]).blocks == 1 and index.prefix(URL, [0]).blocks == 0
            publisher.close()
            await _until(lambda: not index.live(URL))
            assert index.replicas[URL].why_stale == "the publisher does not answer"
            assert index.prefix(URL, [10]).blocks == 0  # forgotten: rebuilt when it answers again
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            context.destroy(linger=0)

    asyncio.run(main())


def test_garbled_messages_are_ignored_with_a_log_line(caplog):
    """A PUB socket sending junk among real batches: the junk is logged and counted, the real
    batches still apply, and a batch garbled on the way is taken from the replay socket."""

    async def main():
        publisher, source = _publisher()
        index = KVIndex(WEIGHTS)
        context = zmq.asyncio.Context()
        try:
            stream = KVStream(URL, source, index, SETTINGS, context)
            task = asyncio.create_task(stream.run())
            await _until(lambda: index.live(URL))
            await asyncio.sleep(0.3)
            with publisher.lock:  # junk on the wire, as a broken or foreign publisher would send
                publisher.pub.send_multipart([b"kv", b"\x00" * 8, b"\xc1 not msgpack"])
                publisher.pub.send_multipart([b"kv", b"short"])
                publisher.pub.send_multipart([b"kv", (0).to_bytes(8, "big"), packb([1.0, [["BlockStored", "x"]]])])
                # batch 0 garbled on its way (kept whole for the replay socket)
                publisher.kept.append((0, packb([1.0, [stored_event([1])]])))
                publisher.seq = 1
                publisher.pub.send_multipart([b"kv", (0).to_bytes(8, "big"), b"\x93garbled"])
            publisher.publish([stored_event([2])])
            await _until(lambda: index.replicas[URL].next_seq == 2)
            assert index.prefix(URL, [1, 2]).blocks == 2 and index.live(URL) and not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            publisher.close()
            context.destroy(linger=0)

    with caplog.at_level(logging.WARNING, logger="llmserve.gateway.kv_subscriber"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "ignored a message" in r.getMessage()]
    assert len(lines) == 1 and "not a KV event batch" in lines[0]  # the rest held back for 10 s


def test_without_a_replay_socket_a_lost_gap_is_forgotten_and_learned_again():
    async def main():
        publisher, source = _publisher(replay=False)
        index = KVIndex(WEIGHTS)
        context = zmq.asyncio.Context()
        try:
            publisher.publish([stored_event([1])])  # missed: nobody subscribed yet
            task = asyncio.create_task(KVStream(URL, source, index, SETTINGS, context).run())
            await asyncio.sleep(0.4)
            assert not index.live(URL)
            publisher.publish([stored_event([2])])
            await _until(lambda: index.live(URL))
            assert index.replicas[URL].next_seq == 2 and index.prefix(URL, [2]).blocks == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            publisher.close()
            context.destroy(linger=0)

    asyncio.run(main())


def test_kv_batch_is_typed():
    got = batch(4, stored_event([1, 2]))
    assert (
        isinstance(got, KVBatch) and got.seq == 4 and got.events == [BlockStored([1, 2], None, [1] * 8, 4, None, "GPU")]
    )


def test_the_router_falls_back_to_taking_turns_when_no_stream_is_live():
    from llmserve.gateway.router import Router

    config = GatewayConfig.model_validate({"models": {"m": {
        "replicas": ["http://a", "http://b"], "routing": "kv_aware",
        "kv_events": {"replicas": {"http://a": {"endpoint": "tcp://127.0.0.1:1"}}}}}})  # fmt: skip
    router = Router(config, None, KVRouting(config))
    prompt = KVPrompt(list(range(40)))
    picks = [router.pick("m", kv_prompt=prompt) for _ in range(4)]
    assert [p.decision for p in picks] == ["kv_fallback"] * 4
    assert sorted(p.replica.url for p in picks) == ["http://a", "http://a", "http://b", "http://b"]
    index = router.kv.indexes["m"]
    index.apply("http://a", batch(0, stored_event(prompt.hashes(4)[:2])))  # (its block size: 4)
    index.set_live("http://a", True)
    for _ in range(2):
        pick = router.pick("m", kv_prompt=prompt)
        assert pick.replica.url == "http://a" and pick.decision == "kv_prefix"
    assert router.pick("m", kv_prompt=KVPrompt([7] * 40)).decision == "kv_load"
