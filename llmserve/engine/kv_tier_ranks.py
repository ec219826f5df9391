"""The KV cache tiers under tensor parallelism: each rank keeps its own shard of every block.

Rank 0 (the scheduler's) decides every move, as it does the block tables: which device block goes
to which host block, which host block to which disk slot, which block is read back into which
device block. The moves travel with the step to every rank (`StepInputs`), and each rank copies its
own shard (its KV heads) between its device cache, its host memory and its own arena file:

    DIR/kv_arena-tp{rank}of{size}.{bin,json,lock}   (one rank alone: DIR/kv_arena.*)
    DIR/kv_arena-pp{stage}of{stages}-tp{rank}of{size}.*   (pipeline parallelism: each stage its layers)

A rank's fingerprint names its rank and the group's size, and its pipeline stage, the stage count and
the stage's layers, so a restart with another tensor- or pipeline-parallel size never loads another
split's shards (its files have other names, too).

Under pipeline parallelism "every rank" is every rank of every stage: a stage holds the KV of its own
layers only, so a block is loaded on every stage or on none (the agreements below are over the whole
world group), and every stage's file has the same number of slots (the fewest any rank has room for).

Disk reads are the one move that can fail on one rank and not another (a torn slot, an I/O error,
a write that failed on that rank only). A prefix hit on disk is therefore decided by every rank:
when a request is admitted, rank 0 sends the run of blocks it wants read (`read_on_every_rank`,
a mirrored call), each rank reads and checks its own shards into memory, and the ranks agree on
the shortest run that every one of them read (one MIN over the group). The blocks past it are a
miss on every rank, and dropped from every rank's memory; rank 0 forgets the first of them. So a
block is loaded on every rank or on none. The alternative, trusting the other ranks' files to hold
what rank 0's does, fails the first time one rank's write fails: that rank would load garbage.

Which read-back blocks a rank keeps in memory follows rank 0 too: the stage ids are rank 0's, a
load takes its block on every rank, and a block rank 0 drops unloaded is dropped by the others with
the next read (`DiskStore.stage_run`'s `drops`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch.distributed as dist

from llmserve.engine.kv_disk_store import DiskStore, SlotMeta, disk_fingerprint

logger = logging.getLogger(__name__)


def store_name(rank: int, world_size: int, stage: int = 0, stages: int = 1) -> str:
    """The stem of a rank's arena files (one rank: the plain `kv_arena`)."""
    if stages > 1:
        return f"kv_arena-pp{stage}of{stages}-tp{rank}of{world_size}"
    return "kv_arena" if world_size == 1 else f"kv_arena-tp{rank}of{world_size}"


def min_over_every_rank(runner, value: int) -> int:
    """The smallest of every rank's `value`: its tensor-parallel group's, or under pipeline
    parallelism every stage's too (every rank must call it)."""
    link = getattr(runner.stage, "link", None)
    if link is not None:
        return link.min_over_world(value)
    return runner.tp.min_over_ranks(value)


def open_rank_store(config, runner, max_staged: int) -> tuple[DiskStore | None, int]:
    """This rank's disk store, if every rank could open one of the same number of slots (else
    none on any rank: a tier some ranks lack is no tier); and this rank's errors opening it."""
    cc, tp, stage = config.cache_config, runner.tp, runner.stage.stage
    block_bytes = sum(c[:, 0].numel() * c.element_size() for c in runner.host_tier_caches)
    capacity = cc.kv_offload_disk_bytes
    if stage.count > 1:  # the stages' blocks differ in size (their layers): the same slots on every stage
        slot_bytes = DiskStore.slot_size(cc.block_size, block_bytes)
        capacity = min_over_every_rank(runner, capacity // slot_bytes) * slot_bytes
    store = DiskStore(cc.kv_offload_disk_path, capacity, block_bytes, cc.block_size,
                      disk_fingerprint(config, runner, block_bytes), max_staged=max_staged,
                      name=store_name(tp.rank, tp.world_size, stage.index, stage.count))  # fmt: skip
    slots = store.num_slots if store.enabled else 0
    fewest, most = min_over_every_rank(runner, slots), -min_over_every_rank(runner, -slots)
    if fewest == most and fewest > 0:
        return store, store.counts.errors
    if store.enabled and tp.rank == 0 and stage.index == stage.count - 1:
        logger.warning("KV disk tier off: another rank could not use %s (or has another slot count); "
                       "prefixes past the host tier are recomputed", cc.kv_offload_disk_path)  # fmt: skip
    errors = store.counts.errors
    store.close()
    return None, errors


def read_on_every_rank(store: DiskStore, runner, reads: list[tuple[int, int, SlotMeta]], drops: list[int]) -> int:
    """Each rank's part of a read rank 0 asked for: read its own shards, agree on how many every
    rank (of every stage) read, drop the rest; that number."""
    done = store.read_staged(reads, drops)
    agreed = min_over_every_rank(runner, done)
    store.unstage([stage_id for stage_id, _, _ in reads[agreed:done]])
    return agreed


@dataclass
class RankTierCounts:
    """One rank's own copies between its tiers (each a block's shard)."""

    rank: int = 0  # the tensor-parallel rank
    stage: int = 0  # the pipeline stage
    host_stored: int = 0  # device -> host memory
    host_loaded: int = 0  # host memory -> device
    disk_spilled: int = 0  # handed to the disk store's writer
    disk_loaded: int = 0  # read back from disk into the device
    disk_written: int = 0  # written to this rank's file
    disk_read: int = 0  # read and checked from it (a read not every rank made is not loaded)
    disk_errors: int = 0
    disk_corrupt: int = 0

    def with_store(self, store: DiskStore | None) -> dict:
        counts = asdict(self)
        if store is not None:
            c = store.counts
            counts.update(disk_written=c.written, disk_read=c.read, disk_errors=c.errors, disk_corrupt=c.corrupt)
        return counts


def gather_counts(runner, mine: dict) -> list[dict]:
    """Every rank's counts, in global rank order (every rank calls it): under pipeline parallelism
    every stage's ranks, the last stage's first (its rank 0 is the driver)."""
    link = getattr(runner.stage, "link", None)
    if link is not None:
        mine = {**mine, "stage": runner.stage.stage.index}
        every: list[dict | None] = [None] * dist.get_world_size(link.world_cpu_group)
        dist.all_gather_object(every, mine, group=link.world_cpu_group)
        return every
    tp = runner.tp
    if tp.world_size == 1:
        return [mine]
    every = [None] * tp.world_size
    dist.all_gather_object(every, mine, group=tp.cpu_group)
    return every
