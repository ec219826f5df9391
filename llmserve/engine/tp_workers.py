"""Tensor-parallel (and pipeline) worker ranks: the worker loop and the driver's side.

Rank 0 is the engine core's own ModelRunner (the driver); ranks 1..N-1 each run a
ModelRunner of their own, one per GPU (or CPU process with gloo), started by an executor
(engine/executor.py): a process on this machine (`mp`, the default) or a Ray actor on any node
of a cluster (`ray`). The driver sends every call that touches the model (`on_every_rank`
methods of ModelRunner) to the workers over a connection before running it itself, so all
ranks run the same forward in lockstep and meet in the same collectives; only the driver
schedules and samples. `serve_rank` is the worker's loop wherever it runs.

Failure handling: a worker that exits breaks its connection (the next step raises
`WorkerDiedError`) and, on CPUs, the gloo collective it was part of (raises at once).
NCCL collectives would wait forever instead, so in the engine core process a monitor
thread ends the process when a worker dies and the step does not fail by itself; the
front then reports the engine dead. Workers exit when their connection closes or (processes)
their parent disappears; Ray ends the actors of an engine core that died.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from llmserve.config import EngineConfig
from llmserve.engine.executor import RankSpec, WorkerHandle, executor_for
from llmserve.engine.pp_stages import StagePlace, join_stages
from llmserve.heap import freeze_startup_objects, unfreeze
from llmserve.model.tensor_parallel import TPGroup
from llmserve.net import free_port

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS) is unavailable on the lent machines; every rank runs without it
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot continue."""


def init_distributed(spec: RankSpec, world_size: int, device: str, expert_parallel: bool = False) -> TPGroup:
    """Join the group at `spec.rendezvous` (NCCL_ENV is already set: by the driver, inherited by
    worker processes, set by actors); `expert_parallel`: a mixture of experts splits whole experts
    over it."""
    rank = spec.rank
    if device == "cuda":
        torch.cuda.set_device(spec.device_index)
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://{spec.rendezvous}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    cpu_group = dist.new_group(backend="gloo") if device == "cuda" else dist.group.WORLD
    return TPGroup(rank, world_size, cpu_group, expert_parallel)


def join_engine_group(config: EngineConfig, spec: RankSpec) -> tuple[TPGroup, StagePlace]:
    """Join the engine's ranks: with one pipeline stage, the tensor-parallel group itself; with
    several, every stage's tensor-parallel group and this rank's stage (engine/pp_stages.py)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    group = init_distributed(spec, tp * pp, config.device, config.enable_expert_parallel)
    if pp == 1:
        return group, StagePlace(spec.rank, device_index=spec.device_index)
    arch = config.model_config.arch
    return join_stages(spec.rank, tp, pp, config.device, arch.num_layers, arch.hidden_size, group.cpu_group,
                       config.enable_expert_parallel, spec.device_index)  # fmt: skip


def shutdown_distributed(timeout: float = 10.0) -> None:
    """Leave the process group. Every rank tears down at the same time (NCCL's teardown
    waits for the peers); a teardown that a dead peer blocks is left behind after
    `timeout` rather than hanging the caller."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    teardown = threading.Thread(target=dist.destroy_process_group, daemon=True, name="tp-teardown")
    teardown.start()
    teardown.join(timeout)
    if teardown.is_alive():
        logger.warning("process group teardown did not finish within %.0f s; left behind", timeout)


def serve_rank(config: EngineConfig, spec: RankSpec, conn: Connection) -> bool:
    """The worker loop, the same in a process and in a Ray actor: build this rank's shard, then
    run what the driver sends until it says stop or the connection closes (True: a clean end,
    the group left). False: it failed (the driver was told why); the caller exits at once, as a
    collective with the others may never return."""
    from llmserve.engine.model_runner import ModelRunner

    runner = None
    try:
        conn.send(("joining", None))
        tp, place = join_engine_group(config, spec)
        runner = ModelRunner(config, progress=False, tp=tp, stage=place)
        freeze_startup_objects(f"tensor-parallel rank {spec.rank}")
        conn.send(("ready", None))
        receive = _read_ahead(conn) if config.pipeline_batches_in_flight > 1 else _read_now(conn)
        while (msg := receive()) is not None:
            name, args = msg
            getattr(runner, name)(*args)
    except Exception as exc:
        logger.exception("tensor-parallel worker %d failed", spec.rank)
        with contextlib.suppress(OSError):
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return False
    finally:
        conn.close()
    unfreeze()
    if runner is not None:
        if runner.disk_store is not None:  # its queued writes finish, for a restart to find
            runner.disk_store.close()
        runner.release_cuda_graphs()  # before NCCL's teardown, which waits for them
    shutdown_distributed()
    return True


def _read_now(conn: Connection) -> Callable[[], tuple | None]:
    """The driver's next call, read when asked (None: stop, or the connection closed)."""

    def receive() -> tuple | None:
        try:
            return conn.recv()
        except (EOFError, OSError):
            return None

    return receive


def _read_ahead(conn: Connection) -> Callable[[], tuple | None]:
    """The driver's calls, read as they come by a thread of their own and taken in order: with
    several batches in flight the driver mirrors batch N+1 while this rank may still wait in
    batch N's hand-over to the driver (gloo's send waits for the receive), so the connection
    must never fill up behind that wait."""
    calls: queue.SimpleQueue = queue.SimpleQueue()

    def reader() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
            calls.put(msg)
            if msg is None:
                return

    threading.Thread(target=reader, daemon=True, name="tp-calls").start()
    return calls.get


def worker_main(config: EngineConfig, spec: RankSpec, conn: Connection) -> None:
    """Entry point of a worker process (the `mp` executor)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s tp-rank{spec.rank} %(name)s: %(message)s")
    parent = os.getppid()

    def orphan_watch() -> None:  # a collective cannot notice a vanished driver on its own
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphan_watch, daemon=True, name="tp-orphan-watch").start()
    # nothing left to run either way; skip interpreter teardown of the CUDA/NCCL state
    os._exit(0 if serve_rank(config, spec, conn) else 1)


class TPDriver:
    """Rank 0's side of the group: has the executor start the workers, and sends them each call."""

    def __init__(self, config: EngineConfig, exit_on_worker_death: bool = False) -> None:
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine already runs in this process (one per process)")
        for key, value in NCCL_ENV.items():  # the driver's own, inherited by worker processes
            os.environ.setdefault(key, value)
        self.executor = executor_for(config)
        self.workers: list[WorkerHandle] = []
        self._closed = threading.Event()
        self.exit_on_worker_death = exit_on_worker_death
        atexit.register(self.close)  # an LLM nobody shut down must not keep its workers
        try:
            placement = self.executor.place(world)
            port = free_port()  # on this node, where rank 0's store listens
            self.workers = self.executor.launch(config, [placement.spec(rank, port) for rank in range(1, world)])
            threading.Thread(target=self._monitor, daemon=True, name="tp-monitor").start()
            self._await_all("joining")  # a worker that died before the rendezvous would hang it
            self.group, self.stage_place = join_engine_group(config, placement.spec(0, port))
        except BaseException:
            self.close()
            raise
        how = f"{self.executor.name} executor, workers {[w.where for w in self.workers]}"
        if config.pipeline_parallel_size > 1:
            logger.info("pipeline parallel: %d stages x %d tensor-parallel ranks (%s)",
                        config.pipeline_parallel_size, config.tensor_parallel_size, how)  # fmt: skip
        else:
            logger.info("tensor parallel: %d ranks (workers %s), %s executor", world, self.worker_pids,
                        self.executor.name)  # fmt: skip

    def wait_ready(self) -> None:
        """Wait until every worker has built its shard (before the first collective: a worker
        that failed to load would leave the driver waiting in it)."""
        self._await_all("ready")

    def _await_all(self, expected: str) -> None:
        for w in self.workers:
            while True:
                ready = wait([w.conn, w.sentinel])
                if w.conn in ready:
                    try:
                        kind, detail = w.conn.recv()
                    except (EOFError, OSError):
                        raise WorkerDiedError(self._death_message(w)) from None
                    if kind == "failed":
                        raise WorkerDiedError(f"tensor-parallel worker rank {w.rank} failed: {detail}")
                    if kind == expected:
                        break
                elif w.sentinel in ready:
                    raise WorkerDiedError(self._death_message(w))

    @property
    def worker_pids(self) -> list[int]:
        """The workers' process ids (each on its own node under Ray)."""
        return [w.pid for w in self.workers]

    def send(self, name: str, args: tuple) -> None:
        """Ask every worker to run `ModelRunner.<name>(*args)` (the driver runs it too)."""
        for w in self.workers:
            try:
                w.conn.send((name, args))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                raise WorkerDiedError(self._death_message(w)) from None

    def _death_message(self, w: WorkerHandle) -> str:
        return f"tensor-parallel worker rank {w.rank} ({w.where}) died ({self.executor.death_cause(w)})"

    def _monitor(self) -> None:
        sentinels = {w.sentinel: w for w in self.workers}
        while sentinels and not self._closed.is_set():
            for ready in wait(list(sentinels), timeout=1.0):
                w = sentinels.pop(ready)
                if self._closed.is_set():
                    return
                logger.error("%s", self._death_message(w))
                if self.exit_on_worker_death and not self._closed.wait(10.0):
                    # the step is stuck in a collective with a dead peer: end the process,
                    # so that the front reports the engine dead instead of hanging
                    logger.error("the engine cannot go on without that worker; exiting")
                    os._exit(1)

    def close(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group."""
        if self._closed.is_set():
            return
        self._closed.set()
        atexit.unregister(self.close)
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        shutdown_distributed()  # together with the workers, which leave on the None
        self.executor.stop(self.workers, timeout=10.0)
        for w in self.workers:
            w.conn.close()
