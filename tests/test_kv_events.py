"""KV cache events in vLLM's format (engine/kv_events.py): decoded by msgspec with vLLM's event
types, published per step over ZMQ, replayed on request; block hashes a router can compute."""

from __future__ import annotations

import json
import random
import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, kv_events_config
from llmserve.engine.kv_events import block_hashes, packb

pytestmark = pytest.mark.unit


# vLLM's event types, as its subscribers declare them (array-like structs, tagged by class name)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def test_packb_is_msgpack():
    rng = random.Random(0)
    values = [None, True, False, 0, 5, 127, 128, -1, -32, -33, 2**63 - 1, -(2**63), 0.25, "", "x" * 40, b"ab",
              [], list(range(20)), [[1, [2, None]], "s"], [rng.randrange(-(2**40), 2**40) for _ in range(50)]]  # fmt: skip
    for value in values:
        assert msgspec.msgpack.decode(packb(value)) == value


def test_a_batch_decodes_as_vllm_s_types():
    events = [["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "GPU"], ["BlockRemoved", [7], "GPU"],
              ["AllBlocksCleared"]]  # fmt: skip
    batch = DECODER.decode(packb([12.5, events]))
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [7] and stored.token_ids == [1, 2, 3, 4]
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared) and batch.ts == 12.5


@pytest.mark.parametrize(
    "value, message",
    [
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
        ("{x", "not JSON"),
        ({"enable_kv_cache_events": True, "port": 1}, "unknown key"),
    ],  # fmt: skip
)
def test_bad_kv_events_configs_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        kv_events_config(value)


def test_kv_events_off_unless_enabled():
    assert kv_events_config(None) is None
    assert kv_events_config({"enable_kv_cache_events": False}) is None
    assert kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}) is None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive(sub, until: float = 1.0) -> list[tuple[int, KVEventBatch]]:
    out = []
    while sub.poll(int(until * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        until = 0.3
    return out


def test_the_engine_publishes_its_cache_changes_and_replays_them(llama_dir):
    """Stored blocks carry the hashes a router computes from the prompt; evicted ones are removed
    (and stored on the host tier), a reset clears all; a subscriber that missed batches gets them
    from the replay socket."""
    pub, replay = _port(), _port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}  # fmt: skip
    llm = LLM(llama_dir, max_model_len=128, block_size=8, num_gpu_blocks_override=20, admission_reserve_tokens=0,
              kv_events_config=json.dumps(config), kv_offload_cpu_gb=0.001)  # fmt: skip
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # (a PUB drops what it sends before the subscription arrives)
    try:
        rng = random.Random(2)
        prompt = [1] + [rng.randrange(3, 500) for _ in range(40)]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        batches = _receive(sub)
        stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored) and e.medium == "GPU"]
        want = block_hashes(prompt, 8)
        assert [e.block_hashes[0] for e in stored][: len(want)] == want
        assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == want[0]
        assert stored[0].token_ids == prompt[:8] and stored[0].block_size == 8
        for _ in range(2):  # other prompts take every device block: the first one's blocks go
            other = [1] + [rng.randrange(3, 500) for _ in range(60)]
            llm.generate([{"prompt_token_ids": other}], params, use_tqdm=False)
        later = _receive(sub)
        removed = {h for _, b in later for e in b.events if isinstance(e, BlockRemoved) and e.medium == "GPU"
                   for h in e.block_hashes}  # fmt: skip
        on_host = {h for _, b in later for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU"
                   for h in e.block_hashes}  # fmt: skip
        assert set(want) & removed and set(want) & on_host
        assert llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": prompt[:9]}], params, use_tqdm=False)  # (a step publishes the reset)
        cleared = _receive(sub)
        assert any(isinstance(e, AllBlocksCleared) for _, b in cleared for e in b.events)
        seqs = [s for s, _ in batches + later + cleared]
        assert seqs == list(range(len(seqs)))  # one sequence, no gap
        # (a DEALER reads every reply: the ROUTER answers a request with one message a batch, then
        # the end marker, as vLLM's replay socket does)
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(2000):
            _, seq, payload = dealer.recv_multipart()
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed.append(int.from_bytes(seq, "big"))
            assert DECODER.decode(payload).events
        assert replayed == seqs[1:]
    finally:
        context.destroy(linger=0)
        llm.core.shutdown()
