"""The `ray` executor (`--distributed-executor-backend ray`): worker ranks as Ray actors on the
nodes of a Ray cluster.

- **The cluster.** The engine core joins the cluster `RAY_ADDRESS` names (or the one `ray start`
  left on this machine), else starts a local one, as `ray.init()` resolves it; it leaves (and a
  local cluster it started ends) when the engine stops.
- **Placement.** One placement group per engine core, a bundle per rank: one GPU each (on CPUs
  `num_cpus` CPUs each), bundle 0 held on this node for rank 0, the driver, whose process is not
  an actor. The strategy is `PACK` (as few nodes as fit, as vLLM) unless told otherwise:
  `STRICT_PACK` keeps every rank on one node, `PACK` and `SPREAD` let the ranks span nodes. A group the cluster cannot meet within the timeout is an
  error at start naming what was asked and what the cluster has.
- **The workers.** Each actor listens on its node's address; the driver connects (HMAC-checked
  with a key of this engine's) and from then on drives it exactly as a worker process: the same
  messages over a `Connection`, the same `tp_workers.serve_rank` loop. On GPUs every rank of a
  node sees that node's GPUs of this engine (CUDA_VISIBLE_DEVICES, so NCCL can use NVLink between
  them) and uses its own. torch.distributed meets on this node's address.
- **Failures.** A watcher waits on every actor's `run` call; an actor or node that dies resolves
  it, which closes the worker's sentinel, and the driver fails the engine as it does for a dead
  process (engine/tp_workers.py). Actors are owned by the engine core: if it dies, Ray ends them.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from multiprocessing.connection import Client, Listener

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from llmserve.config import ConfigError, EngineConfig
from llmserve.engine.executor import Placement, RankSpec, WorkerHandle, placement_from_gpus

logger = logging.getLogger(__name__)

ACTOR_START_TIMEOUT = 180.0  # seconds for the actors' processes to start on their nodes
DRIVER_NODE_SHARE = 0.001  # of the `node:<ip>` resource Ray gives every node: holds bundle 0 on this node


class RayPlacementError(ConfigError):
    """The Ray cluster cannot hold the engine's ranks."""


class RankActor:
    """One worker rank in a Ray actor (made remote at launch: Ray is imported only here)."""

    def __init__(self) -> None:
        self._listener: Listener | None = None

    def where(self) -> tuple[str, str, list[str], int]:
        """(node id, node address, the GPU ids Ray gave this actor, pid)."""
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()], os.getpid()

    def listen(self, authkey: bytes) -> tuple[str, int]:
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        return self._listener.address

    def run(self, config: EngineConfig, spec: RankSpec) -> bool:
        """Serve the driver's calls until it says stop (True) or this rank fails (the actor
        exits: the driver has been told why over the connection)."""
        from llmserve.engine.tp_workers import NCCL_ENV, serve_rank

        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s tp-rank{spec.rank} %(name)s: %(message)s")
        for key, value in NCCL_ENV.items():
            os.environ.setdefault(key, value)
        if spec.visible_devices is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
        conn = self._listener.accept()
        self._listener.close()
        if not serve_rank(config, spec, conn):
            os._exit(1)
        return True


def _cluster_summary() -> str:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total, free = ray.cluster_resources(), ray.available_resources()
    per_node = "; ".join(
        f"{n['NodeManagerAddress']}: {n['Resources'].get('GPU', 0):g} GPU, {n['Resources'].get('CPU', 0):g} CPU"
        for n in nodes
    )
    return (f"the cluster has {len(nodes)} node(s), {total.get('GPU', 0):g} GPUs ({free.get('GPU', 0):g} free) and "
            f"{total.get('CPU', 0):g} CPUs ({free.get('CPU', 0):g} free) [{per_node}]")  # fmt: skip


class RayExecutor:
    name = "ray"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.settings = config.executor
        self.started_ray = False
        self.group = None  # the placement group
        self.actors: dict[int, object] = {}  # rank -> actor handle (rank 0: the GPU holder, on GPUs)
        self.nodes: dict[int, str] = {}  # rank -> the node id it was placed on (rank 0: bundle 0's)
        self._pids: dict[int, int] = {}
        self._runs: dict[int, object] = {}  # rank -> the ObjectRef of its `run` call
        self._gone: dict[int, int] = {}  # rank -> the write end of its sentinel pipe
        self._closed = threading.Event()
        self._lock = threading.Lock()  # the sentinels' write ends: closed by the watcher or by stop

    # -- placement ----------------------------------------------------------------------------
    def place(self, world_size: int) -> Placement:
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)  # RAY_ADDRESS, a cluster on this machine, or a new one
            self.started_ray = True
        host = ray.util.get_node_ip_address()
        gpu = self.config.device == "cuda"
        unit = {"GPU": 1.0} if gpu else {"CPU": float(self.settings.num_cpus)}
        bundles = [{**unit, f"node:{host}": DRIVER_NODE_SHARE}] + [dict(unit) for _ in range(world_size - 1)]
        strategy, timeout = self.settings.placement_strategy, self.settings.placement_timeout_s
        self.group = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=timeout)
        except GetTimeoutError:
            summary = _cluster_summary()
            remove_placement_group(self.group)
            self.group = None
            what = f"{world_size} GPUs" if gpu else f"{world_size} x {self.settings.num_cpus:g} CPUs"
            hint = (" (STRICT_PACK puts every rank on one node: --ray-placement-strategy PACK or SPREAD spans nodes)"
                    if strategy == "STRICT_PACK" else "")  # fmt: skip
            raise RayPlacementError(
                f"the Ray cluster could not place {world_size} ranks within {timeout:g} s: they need {what}, "
                f"one rank on this node ({host}), placement strategy {strategy}{hint}; {summary}"
            ) from None
        table = ray.util.placement_group_table(self.group)["bundles_to_node_id"]
        self.nodes = {rank: table[rank] for rank in range(world_size)}
        remote, tag = ray.remote(RankActor), secrets.token_hex(4)
        for rank in range(0 if gpu else 1, world_size):  # on GPUs an actor holds rank 0's GPU for the driver
            opts = {"num_gpus": 1, "num_cpus": 0} if gpu else {"num_cpus": self.settings.num_cpus}
            self.actors[rank] = remote.options(
                name=f"llmserve-{tag}-rank{rank}",  # (`ray list actors` tells whose it is)
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
                **opts,
            ).remote()
        started = ray.get([a.where.remote() for a in self.actors.values()], timeout=ACTOR_START_TIMEOUT)
        where = dict(zip(self.actors, started))
        self._pids = {rank: w[3] for rank, w in where.items()}
        places = ", ".join(f"rank {r} on node {n[:12]}" for r, n in self.nodes.items())
        logger.info("Ray placement (%s): %s", strategy, places)
        tp = self.config.tensor_parallel_size
        for first in range(0, world_size, tp):  # a tensor-parallel group's ranks are consecutive
            spanned = {self.nodes[r] for r in range(first, first + tp)}
            if len(spanned) > 1:
                logger.warning("the tensor-parallel group of ranks %d-%d spans %d nodes: its all-reduces cross the "
                               "network", first, first + tp - 1, len(spanned))  # fmt: skip
        if not gpu:
            return Placement(host, (0,) * world_size, (None,) * world_size)
        return placement_from_gpus(
            host, world_size, {rank: (w[0], w[2]) for rank, w in where.items()}, os.environ.get("CUDA_VISIBLE_DEVICES")
        )  # (the driver process's own view)

    # -- the workers -----------------------------------------------------------------------------
    def launch(self, config: EngineConfig, specs: list[RankSpec]) -> list[WorkerHandle]:
        authkey = secrets.token_bytes(32)
        addresses = ray.get([self.actors[s.rank].listen.remote(authkey) for s in specs])
        handles = []
        for spec, address in zip(specs, addresses):
            self._runs[spec.rank] = self.actors[spec.rank].run.remote(config, spec)
            conn = Client(tuple(address), authkey=authkey)
            gone, self._gone[spec.rank] = os.pipe()
            where = f"Ray actor pid {self._pids[spec.rank]} on {address[0]} (node {self.nodes[spec.rank][:12]})"
            handles.append(WorkerHandle(spec.rank, conn, gone, self._pids[spec.rank], where))
        threading.Thread(target=self._watch, daemon=True, name="ray-actor-watch").start()
        return handles

    def _watch(self) -> None:
        """Close a rank's sentinel once its `run` call ends (the actor or its node died, or it left)."""
        pending = {ref: rank for rank, ref in self._runs.items()}
        while pending and not self._closed.is_set():
            done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            with self._lock:
                for ref in done:
                    fd = self._gone.pop(pending.pop(ref), None)
                    if fd is not None:
                        os.close(fd)

    def death_cause(self, handle: WorkerHandle) -> str:
        try:
            ray.get(self._runs[handle.rank], timeout=5.0)
        except GetTimeoutError:
            return "its connection closed; Ray still reports the actor running"
        except Exception as exc:  # noqa: BLE001 - Ray's error is the cause to report
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        return "its loop ended"

    def stop(self, handles: list[WorkerHandle], timeout: float) -> None:
        self._closed.set()
        if ray.is_initialized():  # (at interpreter exit Ray's own atexit may have left already)
            if self._runs:
                ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=timeout)
            for actor in self.actors.values():
                ray.kill(actor)
            if self.group is not None:
                remove_placement_group(self.group)
        with self._lock:
            for fd in self._gone.values():
                os.close(fd)
            self._gone.clear()
        if self.started_ray:
            ray.shutdown()
