"""The KV cache tiers under tensor parallelism (engine/kv_tier_ranks.py): each rank keeps its own
shard of every block in its own host memory and its own arena file; rank 0 decides the moves, and
a disk read any rank fails is a miss on every rank. Two real processes with gloo, on CPU."""

from __future__ import annotations

import json
import random
import struct

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.kv_disk_store import _HEAD, DiskStore
from llmserve.engine.kv_tier_ranks import store_name

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BS = 8
HOST_BLOCKS, DISK_BLOCKS = 4, 64


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[1] + [rng.randrange(3, 500) for _ in range(63)] for _ in range(4)]


def _engine(llama_dir, tp: int, bytes_per_block: int, disk_dir=None) -> LLM:
    """A 20-block device cache (each 64-token prompt takes 8), with a 4-block host tier and a
    64-block disk tier when `disk_dir` is given: run twice, the first prompts' blocks come back
    from the host tier and from disk."""
    tiers = {}
    if disk_dir is not None:
        rank_bytes = bytes_per_block // tp  # (the tiers' sizes are per rank: each holds its shard)
        tiers = dict(kv_offload_cpu_gb=HOST_BLOCKS * rank_bytes / (1 << 30), kv_offload_disk_path=str(disk_dir),
                     kv_offload_disk_gb=DISK_BLOCKS * rank_bytes / (1 << 30))  # fmt: skip
    return LLM(llama_dir, tensor_parallel_size=tp, max_model_len=128, block_size=BS, num_gpu_blocks_override=20,
               admission_reserve_tokens=0, **tiers)  # fmt: skip


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _sequence() -> list[list[int]]:
    """Every prompt, then every prompt again from the last: the last ones' blocks come back from
    the device and the host tier, the first ones' from disk."""
    prompts = _prompts()
    return prompts + prompts[::-1]


@pytest.fixture(scope="module")
def plain(llama_dir) -> tuple[int, list[list[int]]]:
    """One rank's block bytes, and its tokens without tiers (which recompute every evicted prefix;
    one rank with tiers gives the same tokens: test_kv_disk_tier.py)."""
    llm = _engine(llama_dir, 1, 0)
    outs = _run(llm, _sequence())
    bpb = llm.core.runner.bytes_per_block
    llm.shutdown()
    return bpb, outs


@pytest.fixture(scope="module")
def tp2_run(llama_dir, plain, tmp_path_factory):
    """A TP=2 engine with tiers over the sequence: its tokens, stats and every rank's counts, and
    its disk directory (written: the engine is shut down)."""
    bpb, _ = plain
    disk = tmp_path_factory.mktemp("tp2")
    llm = _engine(llama_dir, 2, bpb, disk)
    outs = _run(llm, _sequence())
    stats, ranks = llm.stats(), llm.core.runner.tier_counts_by_rank()
    llm.shutdown()  # (every rank's writes finish)
    return disk, outs, stats, ranks


def test_tp2_tiers_give_the_tokens_without_tiers_and_every_rank_copies_its_shard(plain, tp2_run):
    _, want = plain
    disk, outs, s, ranks = tp2_run
    assert outs == want
    assert s.kv_offload_loaded_blocks > 0 and s.kv_disk_loaded_blocks > 0 and s.kv_disk_errors == 0
    assert [r["rank"] for r in ranks] == [0, 1]
    moves = ("host_stored", "host_loaded", "disk_spilled", "disk_loaded", "disk_read", "disk_written")
    for r in ranks:  # every rank made every move, the same ones
        assert all(r[k] > 0 for k in moves), r
        assert {k: r[k] for k in moves} == {k: ranks[0][k] for k in moves}
        assert r["host_loaded"] == s.kv_offload_loaded_blocks and r["disk_loaded"] == s.kv_disk_loaded_blocks
    for rank in (0, 1):  # each rank its own file
        assert (disk / f"{store_name(rank, 2)}.bin").stat().st_blocks > 0


def test_tp2_restart_reuses_each_ranks_file_and_a_bad_shard_is_a_miss_on_every_rank(llama_dir, plain, tp2_run):
    """A restarted TP=2 engine reads each rank's blocks back from its own file. The first prompt's
    fourth block damaged in rank 1's file alone: rank 0 reads it fine, rank 1's check fails, and
    the prefix is cut there on both ranks (three blocks loaded on each, the rest recomputed: the
    same tokens)."""
    bpb, want = plain
    disk = tp2_run[0]
    assert not (disk / "kv_arena.bin").exists()  # (one rank alone, or another split, opens other files)
    prompt = _prompts()[0]
    arena = disk / f"{store_name(1, 2)}.bin"
    data = bytearray(arena.read_bytes())
    slot = json.loads((disk / f"{store_name(1, 2)}.json").read_text())["slot_bytes"]
    probe = DiskStore(str(disk / "probe"), 1 << 20, 4096, BS, {})
    header = probe.header_bytes  # (the same block size: the same header)
    probe.close()
    fourth = struct.pack(f"<{BS}q", *prompt[3 * BS : 4 * BS])
    damaged = 0
    for start in range(0, len(data), slot):
        if data[start : start + 4] == b"LSKV" and data[start + _HEAD.size : start + _HEAD.size + 8 * BS] == fourth:
            data[start + header + 10] ^= 0xFF  # (a byte of the block: the header still checks out)
            damaged += 1
    assert damaged == 1
    arena.write_bytes(bytes(data))

    again = _engine(llama_dir, 2, bpb, disk)
    assert _run(again, [prompt]) == want[:1]
    s, ranks = again.stats(), again.core.runner.tier_counts_by_rank()
    again.shutdown()
    assert s.kv_disk_hit_tokens == 3 * BS and s.kv_disk_errors == 0
    assert [r["disk_loaded"] for r in ranks] == [3, 3]
    assert [r["disk_corrupt"] for r in ranks] == [0, 1]
    assert ranks[0]["disk_read"] >= 4  # (rank 0 read the fourth block too; not loaded)
