"""Data parallelism: N engine cores (each its own process, each possibly tensor/pipeline parallel)
behind one front.

`DPCoreClient` speaks `CoreClient`'s interface (send, alive, shutdown; messages and death
reported through the same callbacks), so `AsyncEngine` runs unchanged over it:

    ADD      → one core, picked by `DPBalancer` (prefix affinity, then the shortest queue)
    ABORT    → the core that owns each request
    UTILITY  → every core; one combined answer when all have answered
    OUTPUTS  ← each core's, with the scheduler stats summed over the cores (per core: `stats_by_rank`)

A core that dies makes the whole front dead (health is every core healthy), for the orchestrator
to restart it, as a dead tensor-parallel worker does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from llmserve.config import EngineConfig
from llmserve.engine.core_client import CoreClient
from llmserve.engine.ipc import Kind, UtilityCall, UtilityResult
from llmserve.engine.request import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)


class DPBalancer:
    """Which core takes a request: the core that served the longest prefix of its prompt (its
    prefix cache likely holds it), unless that core has more than `slack` requests in flight above
    the least loaded one; else the least loaded (on ties the one sent the fewest so far). Prefixes are counted in blocks
    of `block_size` tokens, chained hashes of at most `max_blocks` of them, the newest `capacity`
    remembered."""

    def __init__(self, size: int, block_size: int, slack: int = 4, max_blocks: int = 64,
                 capacity: int = 100_000) -> None:  # fmt: skip
        self.loads = [0] * size  # requests in flight per core
        self.block_size = block_size
        self.slack = slack
        self.max_blocks = max_blocks
        self.capacity = capacity
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> the core that last served it
        self.routed = [0] * size  # requests sent to each core, ever
        self.affinity_hits = 0  # requests sent after the prefix they share

    def prefix_hashes(self, token_ids: list[int]) -> list[bytes]:
        """Chained hashes of the prompt's full blocks (the first `max_blocks`)."""
        out, parent = [], b""
        bs = self.block_size
        for i in range(min(len(token_ids) // bs, self.max_blocks)):
            block = ",".join(map(str, token_ids[i * bs : (i + 1) * bs])).encode()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            out.append(parent)
        return out

    def pick(self, token_ids: list[int]) -> int:
        hashes = self.prefix_hashes(token_ids)
        # (equal queues: the core sent the fewest requests, so one-at-a-time traffic alternates)
        least = min(range(len(self.loads)), key=lambda r: (self.loads[r], self.routed[r], r))
        chosen = least
        for h in reversed(hashes):  # the longest prefix seen first
            owner = self._owner.get(h)
            if owner is not None:
                if self.loads[owner] <= self.loads[least] + self.slack:
                    chosen = owner
                    self.affinity_hits += 1
                break
        for h in hashes:
            self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        self.loads[chosen] += 1
        self.routed[chosen] += 1
        return chosen

    def done(self, rank: int) -> None:
        self.loads[rank] = max(0, self.loads[rank] - 1)


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The cores' scheduler stats as one engine's: counts and counters summed, KV usage from the
    summed blocks, per-position and latency tuples summed element by element."""
    total = SchedulerStats()
    for f in dataclasses.fields(SchedulerStats):
        values = [getattr(s, f.name) for s in stats]
        first = values[0]
        if isinstance(first, tuple):
            if all(isinstance(v, tuple) and len(v) == len(first) for v in values) and not any(
                isinstance(x, tuple) for x in first
            ):
                setattr(total, f.name, tuple(sum(col) for col in zip(*values)))
            else:
                setattr(total, f.name, next((v for v in values if v), first))
        elif f.name == "kv_offload_block_bytes":
            setattr(total, f.name, first)
        elif isinstance(first, (int, float)):
            setattr(total, f.name, sum(values))
    total.kv_cache_usage = total.num_blocks_used / total.num_blocks_total if total.num_blocks_total else 0.0
    return total


def combine_results(results: list[UtilityResult]) -> UtilityResult:
    """One answer for a utility every core ran: the first error, else the answers all alike
    (booleans: all true), else each core's in a list."""
    call_id = results[0].call_id
    errors = [f"core {rank}: {r.error}" for rank, r in enumerate(results) if r.error is not None]
    if errors:
        return UtilityResult(call_id, error="; ".join(errors))
    values = [r.result for r in results]
    if all(isinstance(v, bool) for v in values):
        return UtilityResult(call_id, all(values))
    if all(v == values[0] for v in values):
        return UtilityResult(call_id, values[0])
    return UtilityResult(call_id, values)


@contextlib.contextmanager
def _visible_devices(devices: str | None):
    """CUDA_VISIBLE_DEVICES for the core process about to be spawned (it copies the environment)."""
    if devices is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class DPCoreClient:
    """`data_parallel_size` engine cores behind CoreClient's interface (see the module's doc)."""

    def __init__(self, config: EngineConfig, on_message: Callable[[Kind, Any], None],
                 on_dead: Callable[[str], None], start_timeout: float = 900.0) -> None:  # fmt: skip
        size = config.data_parallel_size
        self.on_message = on_message
        self.on_dead = on_dead
        self.balancer = DPBalancer(size, config.cache_config.block_size)
        self.owner: dict[str, int] = {}  # core request id -> rank
        self.rank_stats = [SchedulerStats() for _ in range(size)]
        self._utility: dict[int, list[UtilityResult | None]] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self.clients: list[CoreClient] = []
        try:
            self.clients = self._start(config, start_timeout)
        except BaseException:
            self.shutdown()
            raise
        logger.info("data parallel: %d engine cores (pids %s)", size, [c.proc.pid for c in self.clients])

    def _start(self, config: EngineConfig, start_timeout: float) -> list[CoreClient]:
        """Start the cores: on GPUs one after another, each seeing its own GPUs (the environment a
        spawned process copies); elsewhere all at once."""
        size = config.data_parallel_size
        if config.device == "cuda":
            per_core = config.tensor_parallel_size * config.pipeline_parallel_size
            clients = []
            for rank in range(size):
                with _visible_devices(",".join(str(rank * per_core + i) for i in range(per_core))):
                    clients.append(CoreClient(config, self._from(rank), self._died(rank), start_timeout))
            return clients
        started: list[CoreClient | BaseException | None] = [None] * size

        def start(rank: int) -> None:
            try:
                started[rank] = CoreClient(config, self._from(rank), self._died(rank), start_timeout)
            except BaseException as exc:  # noqa: BLE001 - raised below, after every start ended
                started[rank] = exc

        threads = [threading.Thread(target=start, args=(r,), name=f"dp-start-{r}") for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = next((x for x in started if isinstance(x, BaseException)), None)
        if failed is not None:
            for x in started:
                if isinstance(x, CoreClient):
                    x.shutdown()
            raise failed
        return started  # type: ignore[return-value]

    # -- CoreClient's interface ---------------------------------------------------------------
    def send(self, kind: Kind, payload: Any = None) -> None:
        if kind is Kind.ADD:
            req: EngineCoreRequest = payload
            with self._lock:
                rank = self.balancer.pick(req.prompt_token_ids)
                self.owner[req.request_id] = rank
            self.clients[rank].send(kind, payload)
        elif kind is Kind.ABORT:
            by_rank: dict[int, list[str]] = {}
            with self._lock:
                for request_id in payload:
                    rank = self.owner.pop(request_id, None)
                    if rank is not None:
                        by_rank.setdefault(rank, []).append(request_id)
                        self.balancer.done(rank)
            for rank, ids in by_rank.items():
                self.clients[rank].send(kind, ids)
        elif kind is Kind.UTILITY:
            call: UtilityCall = payload
            with self._lock:
                self._utility[call.call_id] = [None] * len(self.clients)
            for client in self.clients:
                client.send(kind, call)
        else:
            for client in self.clients:
                client.send(kind, payload)

    @property
    def alive(self) -> bool:
        return self._dead is None and all(c.alive for c in self.clients)

    def shutdown(self, timeout: float = 5.0) -> None:
        for client in self.clients:
            client.shutdown(timeout)

    # -- per core ------------------------------------------------------------------------------
    def stats_by_rank(self) -> list[SchedulerStats]:
        return list(self.rank_stats)

    def rank_of(self, request_id: str) -> int | None:
        """The core a request in flight runs on (its core request id)."""
        return self.owner.get(request_id)

    def _from(self, rank: int) -> Callable[[Kind, Any], None]:
        def on_message(kind: Kind, payload: Any) -> None:
            if kind is Kind.OUTPUTS:
                self._outputs(rank, payload)
            elif kind is Kind.UTILITY_RESULT:
                self._utility_result(rank, payload)
            else:
                self.on_message(kind, payload)

        return on_message

    def _outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        with self._lock:
            self.rank_stats[rank] = outputs.stats
            for out in outputs.outputs:
                if (out.finish_reason is not None or out.error is not None) and self.owner.pop(
                    out.request_id, None
                ) is not None:
                    self.balancer.done(rank)
            total = sum_stats(self.rank_stats)
        self.on_message(Kind.OUTPUTS, EngineCoreOutputs(outputs.outputs, total, outputs.timestamp))

    def _utility_result(self, rank: int, result: UtilityResult) -> None:
        with self._lock:
            waiting = self._utility.get(result.call_id)
            if waiting is None:
                return
            waiting[rank] = result
            if any(r is None for r in waiting):
                return
            del self._utility[result.call_id]
        self.on_message(Kind.UTILITY_RESULT, combine_results(waiting))

    def _died(self, rank: int) -> Callable[[str], None]:
        def on_dead(reason: str) -> None:
            with self._lock:
                if self._dead is not None:
                    return
                self._dead = f"data-parallel engine core {rank}: {reason}"
            self.on_dead(self._dead)

        return on_dead


def make_core_client(config: EngineConfig, on_message: Callable[[Kind, Any], None], on_dead: Callable[[str], None],
                     start_timeout: float = 900.0) -> CoreClient | DPCoreClient:  # fmt: skip
    """One engine core, or `data_parallel_size` of them behind one client."""
    if config.data_parallel_size > 1:
        return DPCoreClient(config, on_message, on_dead, start_timeout)
    return CoreClient(config, on_message, on_dead, start_timeout)
