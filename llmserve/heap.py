"""Keeping the start-up heap out of the garbage collector's way.

A long-running process (engine core, tensor-parallel worker, API server, gateway) builds
hundreds of thousands of objects at start-up (torch, transformers, the model, compiled
kernels) that live as long as it does. CPython's full collections scan all of them, a stall
of a fraction of a second in the step loop that shows up as a TTFT spike in `bench serve`
(docs/history/benchmarks.md). Freezing moves them to a
generation that is never scanned; requests' own objects are collected as before.

Only for processes that own their whole heap: an `LLM` inside a user's script does not
freeze, since frozen objects that later become cyclic garbage are never freed.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def freeze_startup_objects(what: str) -> int:
    """Collect once, then keep every surviving object out of later scans; returns how many."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects kept out of garbage collection scans", what, frozen)
    return frozen


@contextmanager
def frozen(what: str) -> Iterator[None]:
    """The heap as it is now kept out of collection scans for the block (a benchmark
    measuring an engine it built), then made collectable again."""
    freeze_startup_objects(what)
    try:
        yield
    finally:
        unfreeze()


def unfreeze() -> None:
    """Before tearing down what was frozen (e.g. CUDA graphs that must really be destroyed
    before NCCL's teardown): make it collectable again."""
    gc.unfreeze()
