"""The disk tier's reads in a thread of their own against the scheduler's synchronous read, on a slow
disk (CPU, the tests' random tiny Llama).

Four 64-token prompts through 20 device blocks of 8 tokens and a 4-block host tier put the first
prompt's blocks on disk. That prompt then comes again beside a fresh one, each block's read slowed
by a real sleep (`--delay`): with the reader thread (`DiskReader.delay_s`) and with the scheduler
reading (the synchronous reference, the read wrapped with the same sleep). Prints the first step's
time and when each request finished.

    .venv/bin/python scripts/kv_disk_reader_overlap.py --delay 0.3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from conftest import FAMILY_OVERRIDES, make_random_model  # noqa: E402
from test_kv_disk_reader import GREEDY, _engine, _prompts  # noqa: E402

from llmserve.engine.request import EngineCoreRequest  # noqa: E402


def run(model: str, disk: Path, threaded: bool, delay: float) -> dict:
    warm, (fresh,) = _prompts(4, 5), _prompts(1, 9)
    llm = _engine(disk, model)
    llm.generate([{"prompt_token_ids": p} for p in warm], GREEDY, use_tqdm=False)
    core, kv = llm.core, llm.core.kv
    if threaded:
        kv.disk_reader.delay_s = delay
    else:
        kv.disk_reader = None
        store, read = kv.disk_store, kv.disk_store._read

        def slow_read(slot, meta):
            time.sleep(delay)
            return read(slot, meta)

        store._read = slow_read
    start = time.perf_counter()
    core.add_request(EngineCoreRequest("disk", warm[0], GREEDY, 6, (2,)))
    core.add_request(EngineCoreRequest("fresh", fresh, GREEDY, 6, (2,)))
    finished, first_step = {}, None
    while core.has_unfinished():
        t = time.perf_counter()
        outs = core.step().outputs
        first_step = first_step if first_step is not None else time.perf_counter() - t
        for o in outs:
            if o.finish_reason:
                finished[o.request_id] = round(time.perf_counter() - start, 3)
    loaded = llm.stats().kv_disk_loaded_blocks
    llm.shutdown()
    return {"first_step_s": round(first_step, 3), "finished_s": finished, "disk_blocks_loaded": loaded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay", type=float, default=0.3, help="seconds each disk block's read sleeps")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    model = str(make_random_model(root / "llama", "llama", seed=0, **FAMILY_OVERRIDES["llama"]))
    for threaded in (True, False):
        name = "reader thread" if threaded else "scheduler reads"
        print(name, run(model, root / name.replace(" ", "_"), threaded, args.delay))


if __name__ == "__main__":
    main()
