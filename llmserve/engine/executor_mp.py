"""The `mp` executor (the default): each worker rank a spawned process on this machine, rank r on
GPU r, the rendezvous on 127.0.0.1, a pipe to the driver."""

from __future__ import annotations

import multiprocessing as mp
import time

from llmserve.config import EngineConfig
from llmserve.engine.executor import Placement, RankSpec, WorkerHandle
from llmserve.processes import start_spawned


class MPExecutor:
    name = "mp"

    def __init__(self) -> None:
        self._procs: dict[int, mp.process.BaseProcess] = {}

    def place(self, world_size: int) -> Placement:
        # the GPU count was checked with the config (one per rank on this machine)
        return Placement("127.0.0.1", tuple(range(world_size)), (None,) * world_size)

    def launch(self, config: EngineConfig, specs: list[RankSpec]) -> list[WorkerHandle]:
        from llmserve.engine.tp_workers import worker_main

        ctx = mp.get_context("spawn")
        handles = []
        for spec in specs:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(config, spec, theirs), name=f"llmserve-tp{spec.rank}")
            # (not a daemon: the engine core process that starts it is one, and cannot have those)
            start_spawned(proc)
            theirs.close()
            self._procs[spec.rank] = proc
            handles.append(WorkerHandle(spec.rank, ours, proc.sentinel, proc.pid, f"pid {proc.pid}"))
        return handles

    def death_cause(self, handle: WorkerHandle) -> str:
        proc = self._procs[handle.rank]
        proc.join(1.0)
        return f"exit code {proc.exitcode}"

    def stop(self, handles: list[WorkerHandle], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():  # (every one started, handed out or not)
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
