"""KV cache events in vLLM's format (`--kv-events-config`), for routers that send a request to the
replica that already holds its prefix (llm-d, NVIDIA Dynamo, a gateway).

Each engine step's events go out as one batch on a ZMQ PUB socket: the frames [topic, the batch's
sequence number (8 bytes, big-endian), the batch], the batch msgpack-encoded as vLLM's
`KVEventBatch` (an array [ts, events]; each event an array tagged with its type's name):
`BlockStored` [hashes, parent hash, token ids, block size, LoRA id, medium], `BlockRemoved`
[hashes, medium], `AllBlocksCleared`. A subscriber that missed batches asks the replay socket (a
ROUTER) for those from a sequence number on: it gets each kept batch as [seq, batch], then
[-1 as 8 bytes, empty]. Block hashes are 64-bit integers chained over the blocks' token ids
(and LoRA adapter), so a router can compute a prompt's own hashes (`block_hashes`).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.config import KVEventsConfig
from llmserve.kv_block_hash import block_hash, block_hashes  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

GPU, CPU = "GPU", "CPU"  # the mediums vLLM names
DISK = "DISK"  # the prefix cache's disk tier (engine/kv_disk_tier.py)


# the block hashes a router can compute: llmserve/kv_block_hash.py (a leaf the gateway imports too)


# -- msgpack, the subset the events need --------------------------------------------------------
def packb(value) -> bytes:
    """MessagePack of None, bools, ints (int64 range), floats, strings, bytes and lists."""
    out = bytearray()
    _pack(value, out)
    return bytes(out)


def _pack(v, out: bytearray) -> None:
    if v is None:
        out.append(0xC0)
    elif v is True or v is False:
        out.append(0xC3 if v else 0xC2)
    elif isinstance(v, int):
        if 0 <= v < 128:
            out.append(v)
        elif -32 <= v < 0:
            out.append(v & 0xFF)
        elif v >= 0:
            out += b"\xcf" + struct.pack(">Q", v)
        else:
            out += b"\xd3" + struct.pack(">q", v)
    elif isinstance(v, float):
        out += b"\xcb" + struct.pack(">d", v)
    elif isinstance(v, str):
        data = v.encode()
        out += (bytes([0xA0 | len(data)]) if len(data) < 32 else b"\xdb" + struct.pack(">I", len(data))) + data
    elif isinstance(v, bytes):
        out += b"\xc6" + struct.pack(">I", len(v)) + v
    elif isinstance(v, (list, tuple)):
        out += bytes([0x90 | len(v)]) if len(v) < 16 else b"\xdd" + struct.pack(">I", len(v))
        for item in v:
            _pack(item, out)
    else:
        raise TypeError(f"cannot pack {type(v).__name__}")


# -- events of one step, and the publisher -----------------------------------------------------
@dataclass
class KVEventLog:
    """The current step's events (the block manager adds them), and the hash of each key it has
    announced (to name it again when it goes)."""

    block_size: int
    events: list = field(default_factory=list)
    hashes: dict = field(default_factory=dict)  # (medium, BlockKey) -> hash

    def stored(self, medium: str, key, hash_: int, parent: int | None, lora: str | None) -> None:
        self.hashes[medium, key] = hash_
        self.events.append(["BlockStored", [hash_], parent, list(key.token_ids), self.block_size, None, medium])
        if lora is not None:
            self.events[-1][5] = _lora_id(lora)

    def removed(self, medium: str, key) -> None:
        hash_ = self.hashes.pop((medium, key), None)
        if hash_ is not None:
            self.events.append(["BlockRemoved", [hash_], medium])

    def cleared(self) -> None:
        self.hashes.clear()
        self.events.append(["AllBlocksCleared"])

    def take(self) -> list:
        events, self.events = self.events, []
        return events


def _lora_id(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big")


class KVEventPublisher:
    """The PUB socket and the replay ROUTER (served by a thread)."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.config = config
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.bind(config.endpoint)
        self.seq = 0
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.lock = threading.Lock()
        self.topic = config.topic.encode()
        self._stop = threading.Event()
        self.replay = None
        if config.replay_endpoint:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.bind(config.replay_endpoint)
            threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True).start()

    def publish(self, events: list) -> None:
        if not events:
            return
        payload = packb([time.time(), events])
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.kept.append((seq, payload))
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self.replay.recv_multipart()
            except zmq.ZMQError:
                return
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            with self.lock:
                batches = [(s, p) for s, p in self.kept if s >= start]
            for seq, payload in batches:
                self.replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        time.sleep(0.15)  # the replay thread's poll ends
        self.context.destroy(linger=0)
