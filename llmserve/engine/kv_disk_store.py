"""The disk tier's file (`--kv-offload-disk-path`): one arena of fixed slots, one KV block a slot.

    DIR/kv_arena.json   the fingerprint (model, weights, dtypes, block size, KV layout, tokenizer),
                        the arena's id, the slot size; written atomically (a new file renamed over)
    DIR/kv_arena.bin    slot i at i * slot_bytes: a header (magic, version, flags, the arena's id,
                        the block's chained digest, a write sequence number, its token ids, the
                        payload's CRC-32, the header's CRC-32), then the block's bytes (every layer's
                        K and V, in the cache's dtype: FP8 stays FP8)
    DIR/kv_arena.lock   an exclusive lock: a second engine on the same directory runs without the tier

Each slot names itself, so the headers are the index: a restarted engine whose fingerprint matches
reads every header and keeps the valid ones (its arena, its format, a correct header CRC), least
recently written first; a mismatched fingerprint starts a new arena (a new id: every old slot is
then foreign). A block's bytes are checked (CRC-32, the digest and the tokens) whenever it is read:
a torn or corrupt slot is a miss, never KV.

Reads and writes are `pread`/`pwrite`, not a memory map: writing through a map into a sparse file
on a full disk raises SIGBUS and ends the process, where `pwrite` raises an `OSError` that the tier
turns into a miss (a log line and `errors`). Writes go through one background thread (the step
only copies the blocks out of host memory); until written, a block is read from its pending copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

MAGIC = b"LSKV"
VERSION = 1
PERSISTENT = 1  # header flag: the block may be reused after a restart (no LoRA adapter: an adapter's
# name may name other weights then)
_HEAD = struct.Struct("<4sHH8s16sQI")  # magic, version, flags, arena id, digest, sequence, number of tokens
_CRC = struct.Struct("<I")
LOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(slots=True)
class LoadLatency:
    """A histogram of block-load times (seconds), cumulative, for Prometheus."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.total += seconds
        i = 0
        while i < len(LOAD_BUCKETS) and seconds > LOAD_BUCKETS[i]:
            i += 1
        self.counts[i] += 1

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs, +Inf last."""
        out, running = [], 0
        for le, n in zip([*map(str, LOAD_BUCKETS), "+Inf"], self.counts):
            running += n
            out.append((le, running))
        return out


@dataclass(slots=True)
class DiskCounts:
    written: int = 0  # blocks written to the file
    read: int = 0  # blocks read back (from the file or a pending copy)
    bytes_written: int = 0
    bytes_read: int = 0
    errors: int = 0  # I/O errors (full disk, unwritable directory), each a miss
    corrupt: int = 0  # slots whose header or bytes did not check out, each a miss
    restored: int = 0  # valid slots found at start
    latency: LoadLatency = field(default_factory=LoadLatency)  # reading a block and checking it


def chain_digest(parent: bytes | None, token_ids, salt: str | None) -> bytes:
    """A block's 128-bit identity, stable across processes (Python's `hash` is not): of its
    parent's digest, its token ids and its salt (a LoRA adapter)."""
    h = hashlib.blake2b(parent or b"\0" * 16, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if salt is not None:
        h.update(b"\1" + salt.encode())
    return h.digest()


def group_digest(digest: bytes, group: int) -> bytes:
    """KV group `group`'s block of the block `digest` names (group 0: the block's own digest; a model
    with sliding-window layers keeps each group's blocks apart, engine/kv_layout.py)."""
    if group == 0:
        return digest
    return hashlib.blake2b(digest + struct.pack("<I", group), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class SlotMeta:
    """What a slot's header says of its block."""

    digest: bytes
    token_ids: tuple[int, ...]
    persistent: bool


class DiskPeers(Protocol):
    """Rank 0's calls that every tensor-parallel rank runs on its own store (the model runner's
    mirrored methods)."""

    def read_disk_blocks(self, reads: list[tuple[int, int, SlotMeta]], drops: list[int]) -> int: ...

    def clear_disk_store(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RestoredSlot:
    slot: int
    digest: bytes
    sequence: int


class DiskStore:
    """The arena file, its writer thread and the blocks read back (staged) for the next step."""

    def __init__(self, path: str, capacity_bytes: int, block_bytes: int, block_size: int, fingerprint: dict,
                 max_staged: int = 64, name: str = "kv_arena") -> None:  # fmt: skip
        """`name`: the files' stem (a tensor-parallel rank's own: engine/kv_tier_ranks.py)."""
        self.name = name
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.header_bytes = self.header_size(block_size)
        self.slot_bytes = self.slot_size(block_size, block_bytes)
        self.num_slots = capacity_bytes // self.slot_bytes
        self.counts = DiskCounts()
        self.restored: list[RestoredSlot] = []  # valid slots at start, least recently written first
        self.max_staged = max(1, max_staged)
        self._staged: OrderedDict[int, torch.Tensor] = OrderedDict()  # stage id -> bytes, oldest first
        self._claimed: set[int] = set()  # stage ids a step will load: kept until taken
        self._staged_ids: dict[bytes, int] = {}  # digest -> stage id
        self._next_stage = 0
        # rank 0 under tensor parallelism: every rank's reads (engine/kv_disk_ranks.py); the stage ids
        # it dropped since its last read, for the other ranks to drop too
        self.peers: DiskPeers | None = None
        self._dropped: list[int] = []
        self._lock = threading.Lock()
        self._valid: dict[int, bytes] = {}  # slot -> the digest written there
        self._pending: dict[int, tuple[SlotMeta, torch.Tensor]] = {}  # slot -> the latest write not done
        self._queue: queue.Queue = queue.Queue()
        self._sequence = 0
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._writer: threading.Thread | None = None
        self._last_error_log = 0.0
        if self.num_slots < 1:
            logger.warning("KV disk tier: %d bytes hold no slot of %d bytes; no disk tier", capacity_bytes,
                           self.slot_bytes)  # fmt: skip
            return
        try:
            self._open(Path(path), fingerprint)
        except OSError as e:
            self.counts.errors += 1
            logger.warning("KV disk tier off: %s cannot be used (%s); prefixes past the host tier are recomputed",
                           path, e)  # fmt: skip
            self.close()
            return
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    @staticmethod
    def header_size(block_size: int) -> int:
        """A slot's header bytes (before its block's)."""
        return _HEAD.size + 8 * block_size + 2 * _CRC.size

    @staticmethod
    def slot_size(block_size: int, block_bytes: int) -> int:
        """A slot's bytes in the arena: its header and block, to a 4 KiB page."""
        return -(-(DiskStore.header_size(block_size) + block_bytes) // 4096) * 4096

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    # -- the arena ------------------------------------------------------------------------
    def _open(self, root: Path, fingerprint: dict) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        name = self.name
        self._lock_fd = os.open(root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(f"another engine holds {root / f'{name}.lock'}") from None
        meta_path, arena_path = root / f"{name}.json", root / f"{name}.bin"
        meta = _read_json(meta_path)
        wanted = {"fingerprint": fingerprint, "version": VERSION, "slot_bytes": self.slot_bytes}
        reuse = meta is not None and all(meta.get(k) == v for k, v in wanted.items()) and arena_path.exists()
        if reuse:
            self.arena_id = bytes.fromhex(meta["arena_id"])
        else:
            if meta is not None:
                changed = sorted(k for k, v in wanted["fingerprint"].items() if meta.get("fingerprint", {}).get(k) != v)
                logger.info("KV disk tier: %s holds another model's or format's blocks (%s differ); not reused",
                            root, ", ".join(changed) or "format")  # fmt: skip
            self.arena_id = secrets.token_bytes(8)
        self._fd = os.open(arena_path, os.O_RDWR | os.O_CREAT, 0o644)
        if reuse:
            self._scan(min(self.num_slots, os.fstat(self._fd).st_size // self.slot_bytes))
        else:
            os.ftruncate(self._fd, 0)  # (the old slots are foreign now; free their space)
            tmp = meta_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({**wanted, "arena_id": self.arena_id.hex()}, indent=1, sort_keys=True))
            os.replace(tmp, meta_path)
        os.ftruncate(self._fd, self.num_slots * self.slot_bytes)  # sparse: space is taken as slots are written
        if self.restored:
            logger.info("KV disk tier: %d blocks reused from %s", len(self.restored), root)

    def _scan(self, num_slots: int) -> None:
        """The valid slots' headers (the index), by write sequence."""
        found = []
        for slot in range(num_slots):
            try:
                head = os.pread(self._fd, self.header_bytes, slot * self.slot_bytes)
            except OSError:
                self.counts.errors += 1
                continue
            parsed = self._parse_header(head)
            if parsed is None:
                continue
            meta, sequence, _ = parsed
            if meta.persistent:
                found.append(RestoredSlot(slot, meta.digest, sequence))
        found.sort(key=lambda r: r.sequence)
        seen: dict[bytes, RestoredSlot] = {}
        for r in found:  # one slot per digest: the latest written
            seen.pop(r.digest, None)
            seen[r.digest] = r
        self.restored = list(seen.values())
        self._valid = {r.slot: r.digest for r in self.restored}
        self._sequence = found[-1].sequence + 1 if found else 0
        self.counts.restored = len(self.restored)

    def _encode_header(self, meta: SlotMeta, sequence: int, payload_crc: int) -> bytes:
        tokens = struct.pack(f"<{self.block_size}q", *meta.token_ids)
        head = _HEAD.pack(MAGIC, VERSION, PERSISTENT if meta.persistent else 0, self.arena_id, meta.digest, sequence,
                          len(meta.token_ids)) + tokens + _CRC.pack(payload_crc)  # fmt: skip
        return head + _CRC.pack(zlib.crc32(head))

    def _parse_header(self, head: bytes) -> tuple[SlotMeta, int, int] | None:
        """(meta, sequence, payload CRC) of a valid header of this arena, else None."""
        if len(head) < self.header_bytes or head[:4] != MAGIC:
            return None
        body, (crc,) = head[: self.header_bytes - _CRC.size], _CRC.unpack_from(head, self.header_bytes - _CRC.size)
        if zlib.crc32(body) != crc:
            return None
        magic, version, flags, arena, digest, sequence, n = _HEAD.unpack_from(head)
        if version != VERSION or arena != self.arena_id or n != self.block_size:
            return None
        tokens = struct.unpack_from(f"<{self.block_size}q", head, _HEAD.size)
        (payload_crc,) = _CRC.unpack_from(head, _HEAD.size + 8 * self.block_size)
        return SlotMeta(digest, tokens, bool(flags & PERSISTENT)), sequence, payload_crc

    # -- writes ---------------------------------------------------------------------------
    def write(self, slot: int, meta: SlotMeta, payload: torch.Tensor) -> None:
        """Queue a block's bytes (a uint8 tensor the caller no longer touches) for `slot`."""
        with self._lock:
            self._valid.pop(slot, None)
            self._pending[slot] = (meta, payload)
        self._queue.put((slot, meta, payload))

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            slot, meta, payload = job
            try:
                data = payload.numpy().tobytes()
                with self._lock:
                    sequence, self._sequence = self._sequence, self._sequence + 1
                os.pwrite(self._fd, self._encode_header(meta, sequence, zlib.crc32(data)) + data.ljust(
                    self.slot_bytes - self.header_bytes, b"\0"), slot * self.slot_bytes)  # fmt: skip
                ok = True
            except (OSError, ValueError) as e:  # (ValueError: the file was closed)
                ok = False
                self._error(f"writing slot {slot}", e)
            with self._lock:
                if self._pending.get(slot, (None, None))[1] is payload:  # (not written over since)
                    del self._pending[slot]
                    if ok:
                        self._valid[slot] = meta.digest
                if ok:
                    self.counts.written += 1
                    self.counts.bytes_written += self.block_bytes
            self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write is done."""
        if self._writer is not None:
            self._queue.join()

    def _error(self, what: str, e: Exception) -> None:
        self.counts.errors += 1
        now = time.monotonic()
        if now - self._last_error_log > 10:  # (a full disk fails every write: a line every 10 s)
            self._last_error_log = now
            logger.warning("KV disk tier: %s failed (%s); the block is recomputed when needed (%d errors so far)",
                           what, e, self.counts.errors)  # fmt: skip

    # -- reads ----------------------------------------------------------------------------
    def stage(self, slot: int, meta: SlotMeta) -> int | None:
        """Read and check the block `meta` names from `slot`, kept for the next step's load; its
        stage id, or None (not there, torn, corrupt, or an I/O error: a miss)."""
        staged = self.stage_run([(slot, meta)])
        return staged[0] if staged else None

    def is_staged(self, digest: bytes) -> bool:
        """Is the block `digest` names read back already (waiting for a step's load)?"""
        return digest in self._staged_ids

    def read_block(self, slot: int, meta: SlotMeta) -> torch.Tensor | None:
        """Read and check one block (the reader thread's read: engine/kv_disk_reader.py)."""
        return self._read(slot, meta)

    def stage_run(self, blocks: list[tuple[int, SlotMeta]], ready: dict | None = None) -> list[int]:
        """Read and check a run of blocks, (slot, header) each, kept for a coming step's load: the
        stage ids of the longest prefix of them that read back whole (a block after a miss is of
        no use to a prefix). Under tensor parallelism every rank reads its own shard of each, and
        the prefix is the one every rank read (`peers`: rank 0's, engine/kv_disk_ranks.py).
        `ready`: blocks the reader thread read already, by digest (one rank alone:
        engine/kv_disk_reader.py), staged without reading again."""
        ids, reads = [], []
        for slot, meta in blocks:
            known = self._staged_ids.get(meta.digest)
            if known is None:
                known, self._next_stage = self._next_stage, self._next_stage + 1
                reads.append((known, slot, meta))
            ids.append(known)
        if reads:
            drops, self._dropped = self._dropped, []
            if self.peers is not None:
                done = self.peers.read_disk_blocks(reads, drops)
            else:
                done = self.read_staged(reads, drops, ready)
            failed = reads[done][0] if done < len(reads) else None
            if failed is not None:
                ids = ids[: ids.index(failed)]
            for stage_id, _, meta in reads[:done]:
                self._staged_ids[meta.digest] = stage_id
        for stage_id in ids:
            self._staged.move_to_end(stage_id)
        unclaimed = [s for s in self._staged if s not in self._claimed]
        for old in unclaimed[: max(0, len(unclaimed) - self.max_staged)]:
            self._unstage(old)
            if self.peers is not None:
                self._dropped.append(old)  # (the other ranks drop it with the next read)
        return ids

    def read_staged(
        self, reads: list[tuple[int, int, SlotMeta]], drops: list[int] = (), ready: dict | None = None
    ) -> int:
        """This rank's part of `stage_run`: forget the stage ids `drops`, then read and check each
        (stage id, slot, header) in order, up to the first that fails; how many were read. `ready`:
        digest -> (bytes or None, seconds) of blocks read already (the reader thread's)."""
        for stage_id in drops:
            self._unstage(stage_id)
        for done, (stage_id, slot, meta) in enumerate(reads):
            if ready is not None and meta.digest in ready:
                payload, seconds = ready[meta.digest]
            else:
                start = time.perf_counter()
                payload = self._read(slot, meta)
                seconds = time.perf_counter() - start
            if payload is None:
                return done
            self.counts.latency.observe(seconds)
            self.counts.read += 1
            self.counts.bytes_read += self.block_bytes
            self._staged[stage_id] = payload
        return len(reads)

    def unstage(self, stage_ids: list[int]) -> None:
        """Forget staged blocks (read here, but not by every rank)."""
        for stage_id in stage_ids:
            self._unstage(stage_id)

    def _read(self, slot: int, meta: SlotMeta) -> torch.Tensor | None:
        with self._lock:
            pending = self._pending.get(slot)
            if pending is not None:
                return pending[1].clone() if pending[0] == meta else None
            if self._valid.get(slot) != meta.digest:
                return None
        try:
            data = os.pread(self._fd, self.slot_bytes, slot * self.slot_bytes)
        except (OSError, TypeError) as e:  # (TypeError: the file was closed)
            self._error(f"reading slot {slot}", e)
            self._invalidate(slot)
            return None
        parsed = self._parse_header(data[: self.header_bytes])
        body = data[self.header_bytes : self.header_bytes + self.block_bytes]
        if parsed is None or parsed[0] != meta or len(body) != self.block_bytes or zlib.crc32(body) != parsed[2]:
            self.counts.corrupt += 1
            logger.warning("KV disk tier: slot %d is torn or corrupt; ignored (the block is recomputed)", slot)
            self._invalidate(slot)
            return None
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)

    def _invalidate(self, slot: int) -> None:
        with self._lock:
            self._valid.pop(slot, None)

    def claim(self, stage_id: int) -> None:
        """A step will load this staged block: it stays until `take`n."""
        self._claimed.add(stage_id)

    def take(self, stage_id: int) -> torch.Tensor:
        payload = self._staged[stage_id]
        self._unstage(stage_id)
        return payload

    def _unstage(self, stage_id: int) -> None:
        payload = self._staged.pop(stage_id, None)
        self._claimed.discard(stage_id)
        if payload is not None:
            self._staged_ids = {d: s for d, s in self._staged_ids.items() if s != stage_id}

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset): a new arena id, so none is reused
        (on every rank: `peers`)."""
        if self.peers is not None:
            self.peers.clear_disk_store()
        else:
            self.clear_local()

    def clear_local(self) -> None:
        """This rank's part of `clear`."""
        if not self.enabled:
            return
        self.flush()
        with self._lock:
            self._valid.clear()
            self.restored = []
        self._staged.clear()
        self._staged_ids.clear()
        self._claimed.clear()
        self._dropped = []
        self.arena_id = secrets.token_bytes(8)
        meta_path = self.root / f"{self.name}.json"
        meta = _read_json(meta_path) or {}
        meta["arena_id"] = self.arena_id.hex()
        tmp = meta_path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
            os.replace(tmp, meta_path)
        except OSError as e:
            self._error("renaming the arena", e)

    def close(self) -> None:
        """Finish the queued writes and close the file (a restarted engine then finds them)."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=60)
            self._writer = None
        for name in ("_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)  # (closing the lock file releases the lock)
                setattr(self, name, None)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def weights_fingerprint(model_path: str) -> str:
    """A digest of a checkpoint's files: names, sizes, and their first, middle and last MiB
    (not the whole: a start must not read every weight twice)."""
    root = Path(model_path)
    files = (
        [root] if root.is_file() else sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin"))
    )
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - (1 << 19)), max(0, size - (1 << 20))}):
                f.seek(offset)
                h.update(f.read(1 << 20))
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer_path: str) -> str:
    root = Path(tokenizer_path)
    files = [root] if root.is_file() else sorted(root.glob("tokenizer*")) + sorted(root.glob("*.model"))
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        if p.is_file() and p.stat().st_size < (1 << 30):
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def disk_fingerprint(config, runner, block_bytes: int) -> dict:
    """What must be equal for a block written by one engine to be another's KV: the model and its
    weights, the dtypes, the block size and KV layout, the tokenizer, quantization, FP8 KV scales,
    the tensor-parallel rank and size (a rank's blocks hold its share of the KV heads), and the
    pipeline stage, the stage count and the stage's layers (a stage's blocks hold its layers' KV)."""
    mc, a, tp = config.model_config, runner.arch, runner.tp
    stage = runner.stage.stage
    weights = f"dummy, seed {mc.seed}" if mc.load_format == "dummy" else weights_fingerprint(mc.model)
    fingerprint = {
        "model": mc.model,
        "weights": weights,
        "dtype": str(mc.dtype),
        "kv_dtype": str(runner.kv_dtype),
        "block_size": config.cache_config.block_size,
        "kv_layout": f"{a.num_layers} layers, {a.num_kv_heads} KV heads x {a.head_dim}, {block_bytes} bytes a block, "
        f"{runner.kv_layout}",
        "tokenizer": tokenizer_fingerprint(mc.tokenizer),
        "quantization": f"{mc.quantization} {sorted(mc.quantization_ignore)}",
        "kv_scales": repr(runner.kv_scales.scales),
        "tensor_parallel": f"rank {tp.rank} of {tp.world_size}",
        "format": VERSION,
    }
    if stage.count > 1:  # (one stage: the fingerprint of the arenas written before stages took a disk tier)
        fingerprint["pipeline_parallel"] = f"stage {stage.index} of {stage.count}, layers {stage.start} to {stage.end}"
    return fingerprint
