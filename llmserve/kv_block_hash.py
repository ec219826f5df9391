"""A prompt's KV block hashes as an engine announces them in its KV events (engine/kv_events.py):
64-bit, each block's chained over its parent's hash, its token ids and its LoRA adapter. A leaf
module (no imports from the engine) so the gateway can compute them to route by them;
tests/test_kv_routing.py checks they equal the engine's own."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable


def block_hash(parent: int | None, token_ids: Iterable[int], lora: str | None = None) -> int:
    """One block's hash: of its parent's hash (None for the first block), its token ids and its
    LoRA adapter's key (`LoRARequest.key`); a non-negative int64."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack(">q", -1 if parent is None else parent))
    ids = list(token_ids)
    h.update(struct.pack(f">{len(ids)}q", *ids))
    if lora is not None:
        h.update(lora.encode())
    return int.from_bytes(h.digest(), "big") >> 1


def block_hashes(token_ids: list[int], block_size: int, lora: str | None = None) -> list[int]:
    """The hashes of a prompt's full blocks, first to last (a partial last block has none)."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        out.append(block_hash(out[-1] if out else None, token_ids[start : start + block_size], lora))
    return out
