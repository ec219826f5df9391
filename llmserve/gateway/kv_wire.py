"""A replica's KV event messages read (vLLM's format, as engine/kv_events.py publishes it).

The PUB socket sends [topic, sequence number (8 bytes, big-endian), payload]; the replay socket
answers [seq, payload] per kept batch, then [-1, empty]. A payload is msgpack [ts, events], each
event an array tagged with its type's name: BlockStored [hashes, parent, token ids, block size,
LoRA id, medium], BlockRemoved [hashes, medium], AllBlocksCleared. Anything else is a
`BadMessage`; an event of a type this gateway does not know (a newer publisher's) is skipped,
counted in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

BlockHash = int | bytes  # vLLM's own hashes may be bytes; llmserve's are int64


class BlockStored(msgspec.Struct, array_like=True, tag=True, frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None  # None: GPU (publishers before mediums were named)


class BlockRemoved(msgspec.Struct, array_like=True, tag=True, frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True, frozen=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
KNOWN = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


class _Payload(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]


_PAYLOAD = msgspec.msgpack.Decoder(_Payload)
_EVENT = msgspec.msgpack.Decoder(Event)
_ANY = msgspec.msgpack.Decoder()


class BadMessage(ValueError):
    """A message that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class KVBatch:
    """One publisher step's events."""

    seq: int
    ts: float
    events: list[Event]
    skipped: int = 0  # events of a type not known here


def read_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise BadMessage(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_payload(seq: int, payload: bytes) -> KVBatch:
    try:
        batch = _PAYLOAD.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadMessage(f"batch {seq}: not a KV event batch ({exc})") from None
    events, skipped = [], 0
    for raw in batch.events:
        try:
            events.append(_EVENT.decode(raw))
        except msgspec.DecodeError as exc:
            if _unknown_type(raw):
                skipped += 1
                continue
            raise BadMessage(f"batch {seq}: a malformed event ({exc})") from None
    return KVBatch(seq, batch.ts, events, skipped)


def _unknown_type(raw: msgspec.Raw) -> bool:
    """An event array tagged with a type name this gateway does not know (not a malformed one)."""
    try:
        value = _ANY.decode(raw)
    except msgspec.DecodeError:
        return False
    return isinstance(value, list) and bool(value) and isinstance(value[0], str) and value[0] not in KNOWN


def decode_published(frames: list[bytes], topic: bytes) -> KVBatch:
    """A PUB message [topic, seq, payload]."""
    if len(frames) != 3:
        raise BadMessage(f"a KV event message has 3 frames (topic, seq, batch), got {len(frames)}")
    if frames[0] != topic:
        raise BadMessage(f"topic {frames[0][:40]!r}, not {topic!r}")
    return decode_payload(read_seq(frames[1]), frames[2])
