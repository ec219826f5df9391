"""The disk tier's reads in a thread of their own (one rank alone).

A request whose prefix is partly on disk is admitted only once its blocks are read back and checked;
the reads run here, beside the scheduler and the steps, so a step of other requests launched
meanwhile waits for no file: the request alone waits for its own blocks. The scheduler hands a run of
blocks over (`submit`) and picks the answer up at a later schedule, when the future is done; it then
stages the bytes read as a synchronous read would have (`DiskStore.stage_run`'s `ready`).

`delay_s` is a real delay before each block's read (tests: a slow disk), not a stand-in for the read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from llmserve.engine.kv_disk_store import SlotMeta

# digest -> (the block's bytes, or None: missing, torn or corrupt; seconds the read and check took)
ReadRun = dict[bytes, tuple[torch.Tensor | None, float]]


class DiskReader:
    def __init__(self, read: Callable[[int, SlotMeta], torch.Tensor | None]) -> None:
        """`read`: reads and checks one block (`DiskStore.read_block`), safe beside the writer thread."""
        self._read = read
        self._pool: ThreadPoolExecutor | None = None
        self.delay_s = 0.0

    def submit(self, blocks: list[tuple[int, SlotMeta]]) -> Future[ReadRun]:
        """Read a run of blocks, (slot, header) each, in order up to the first that does not read back."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        return self._pool.submit(self._read_run, list(blocks))

    def _read_run(self, blocks: list[tuple[int, SlotMeta]]) -> ReadRun:
        got: ReadRun = {}
        for slot, meta in blocks:
            if self.delay_s:
                time.sleep(self.delay_s)
            start = time.perf_counter()
            payload = self._read(slot, meta)
            got[meta.digest] = (payload, time.perf_counter() - start)
            if payload is None:
                break
        return got

    def close(self) -> None:
        """Wait for the read under way, if any, and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
