"""How an engine core's worker ranks are started: the interface both executors implement.

The driver (rank 0, the engine core's own ModelRunner) does not care where its workers run:
`mp` starts each as a process on this machine (engine/executor_mp.py), `ray` as a Ray actor on
any node of a Ray cluster (engine/executor_ray.py). Either way a worker is handed a `RankSpec`
(plain data) and a `Connection` to the driver, and runs `tp_workers.serve_rank`, the one worker
loop; the driver sees a `WorkerHandle`: that connection and a sentinel that turns readable once
the worker is gone (for `multiprocessing.connection.wait`, as a process's sentinel does).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

from llmserve.config import EngineConfig


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a worker rank is told of its place; data, the same for a process and an actor."""

    rank: int
    rendezvous: str  # host:port of rank 0's torch.distributed store (the driver's node)
    device_index: int  # the GPU it uses, as numbered under `visible_devices` (unused on CPU)
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES to set before CUDA starts (None: as inherited)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the ranks of one engine core went: the rendezvous host (rank 0's node, reachable by
    every worker) and each rank's GPU index and visible GPUs (rank 0: the driver's own)."""

    host: str
    device_index: tuple[int, ...]
    visible_devices: tuple[str | None, ...]

    def spec(self, rank: int, port: int) -> RankSpec:
        return RankSpec(rank, f"{self.host}:{port}", self.device_index[rank], self.visible_devices[rank])


@dataclass(slots=True)
class WorkerHandle:
    """The driver's side of one started worker."""

    rank: int
    conn: Connection  # calls go out, status ("joining", "ready", "failed") comes back
    sentinel: object  # readable once the worker is gone (multiprocessing.connection.wait)
    pid: int | None  # its process id (on its own node)
    where: str  # for messages: "pid 123", "Ray actor ... on node 10.0.0.2"


def placement_from_gpus(host: str, world_size: int, gpus: dict[int, tuple[str, list[str]]],
                        driver_visible: str | None) -> Placement:  # fmt: skip
    """Each rank's GPU from what a cluster gave it (`gpus`: rank -> (node id, GPU ids); rank 0's:
    what was reserved for the driver): every actor sees its node's GPUs of this engine (so NCCL
    finds NVLink between them) and uses its own; the driver keeps its view (`driver_visible`, its
    CUDA_VISIBLE_DEVICES) and uses the holder's GPU in it."""
    node_gpus: dict[str, set[str]] = {}
    for node, ids in gpus.values():
        node_gpus.setdefault(node, set()).update(ids)
    index, visible = [0] * world_size, [None] * world_size
    for rank, (node, ids) in gpus.items():
        mine = sorted(node_gpus[node], key=int)
        index[rank], visible[rank] = mine.index(ids[0]), ",".join(mine)
    held = gpus[0][1][0]
    index[0], visible[0] = (driver_visible.split(",").index(held) if driver_visible else int(held)), None
    return Placement(host, tuple(index), tuple(visible))


class Executor(Protocol):
    """Reserves room for the ranks, starts the workers, says why one died, stops them."""

    name: str

    def place(self, world_size: int) -> Placement:
        """Reserve a device (or CPUs) per rank, rank 0's on the driver's node; raise a clear
        error when the machine or cluster has too little."""

    def launch(self, config: EngineConfig, specs: list[RankSpec]) -> list[WorkerHandle]:
        """Start one worker per spec (ranks 1..N-1), each running `tp_workers.serve_rank`."""

    def death_cause(self, handle: WorkerHandle) -> str:
        """Why the worker behind `handle` is gone (an exit code, Ray's error), once it is."""

    def stop(self, handles: list[WorkerHandle], timeout: float) -> None:
        """After the workers were asked to leave: wait up to `timeout`, end the rest by force,
        and give back what `place` reserved."""


def executor_for(config: EngineConfig) -> Executor:
    """The executor `config.executor.backend` names (Ray imported only for `ray`)."""
    if config.executor.backend == "ray":
        from llmserve.engine.executor_ray import RayExecutor

        return RayExecutor(config)
    from llmserve.engine.executor_mp import MPExecutor

    return MPExecutor()
