"""The KV cache tiers under tensor parallelism (TP=2) and pipeline parallelism (PP=2), in real
processes over gloo on CPU: each rank (of each stage) keeps its own shard of every block in its own
host memory and its own arena file; prefixes evicted from a tiny device cache come back from host
memory and from disk with the greedy tokens of one process without tiers; a restart of the same
split reuses its files, and another split never loads them, even under the same file names (the
fingerprint names the rank and the stage)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.kv_disk_store import DiskStore
from llmserve.engine.kv_tier_ranks import store_name

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BS = 8
HOST_BLOCKS = 4
DISK_BYTES = 64 * 8192  # (at least 32 slots on every rank: the four prompts' blocks)
SPLITS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}
RANK_FILES = {"tp2": [store_name(r, 2) for r in (0, 1)], "pp2": [store_name(0, 1, s, 2) for s in (0, 1)]}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[1] + [rng.randrange(3, 500) for _ in range(63)] for _ in range(4)]


def _engine(llama_dir, split: dict, host_block_bytes: int = 0, disk_dir=None) -> LLM:
    """A 20-block device cache (each 64-token prompt takes 8), with a 4-block host tier and a disk
    tier when `disk_dir` is given: the prompts twice, the first ones' blocks come back from disk,
    the last ones' from host memory."""
    tiers = {}
    if disk_dir is not None:
        tiers = dict(kv_offload_cpu_gb=HOST_BLOCKS * host_block_bytes / (1 << 30), kv_offload_disk_path=str(disk_dir),
                     kv_offload_disk_gb=DISK_BYTES / (1 << 30))  # fmt: skip
    return LLM(llama_dir, max_model_len=128, block_size=BS, num_gpu_blocks_override=20, admission_reserve_tokens=0,
               **split, **tiers)  # fmt: skip


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _sequence() -> list[list[int]]:
    prompts = _prompts()
    return prompts + prompts[::-1]


@pytest.fixture(scope="module")
def plain(llama_dir) -> tuple[int, list[list[int]]]:
    """One process without tiers (every evicted prefix recomputed): its block bytes and tokens."""
    llm = _engine(llama_dir, {})
    outs = _run(llm, _sequence())
    bpb = llm.core.runner.bytes_per_block
    llm.shutdown()
    return bpb, outs


def _with_tiers(llama_dir, name: str, bpb: int, disk, prompts):
    """An engine of split `name` with tiers over `prompts`: tokens, stats, every rank's counts."""
    # (the host tier's size is per rank: a tensor rank's block is half the heads', a stage's is rank 0's)
    llm = _engine(llama_dir, SPLITS[name], bpb // SPLITS[name].get("tensor_parallel_size", 1), disk)
    try:
        assert llm.core.kv.host.num_blocks == HOST_BLOCKS and llm.core.kv.disk_store is not None
        assert llm.core.kv.disk_reader is None  # (several ranks: the scheduler's mirrored read, below)
        outs = _run(llm, prompts)
        return outs, llm.stats(), llm.core.runner.tier_counts_by_rank()
    finally:
        llm.shutdown()  # (every rank's writes finish)


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_tiers_under_tp_and_pp_equal_one_process_and_restart_reuses_the_files(llama_dir, plain, tmp_path, name):
    bpb, want = plain
    outs, s, ranks = _with_tiers(llama_dir, name, bpb, tmp_path, _sequence())
    assert outs == want
    assert s.kv_offload_loaded_blocks > 0 and s.kv_disk_loaded_blocks > 0 and s.kv_disk_errors == 0
    assert len(ranks) == 2
    if name == "pp2":  # (global rank order: the last stage's rank, the driver, first)
        assert [(r["stage"], r["rank"]) for r in ranks] == [(1, 0), (0, 0)]
    moves = ("host_stored", "host_loaded", "disk_spilled", "disk_loaded", "disk_read", "disk_written")
    for r in ranks:  # every rank made every move, the same ones, on its own shard
        assert all(r[k] > 0 for k in moves), r
        assert {k: r[k] for k in moves} == {k: ranks[0][k] for k in moves}
        assert r["host_loaded"] == s.kv_offload_loaded_blocks and r["disk_loaded"] == s.kv_disk_loaded_blocks
    for stem in RANK_FILES[name]:  # each rank its own file
        assert (tmp_path / f"{stem}.bin").stat().st_blocks > 0
    assert not (tmp_path / "kv_arena.bin").exists()

    # a restart of the same split: the first prompt's blocks all come back from disk
    again, s, ranks = _with_tiers(llama_dir, name, bpb, tmp_path, _prompts()[:1])
    assert again == want[:1]
    assert s.kv_disk_hit_tokens == 7 * BS and [r["disk_loaded"] for r in ranks] == [7, 7]


def test_another_split_never_loads_the_files_even_under_their_names(llama_dir, plain, tmp_path):
    """PP=2's stage files (a stage's block: 1 layer of 2, every head) renamed to TP=2's (a rank's
    block: 2 layers, half the heads: the same bytes): a TP=2 engine finds files of its names and
    slot size, and its fingerprint (rank and stage) refuses them: no disk hit, the same tokens."""
    bpb, want = plain
    written = tmp_path / "pp2"
    _with_tiers(llama_dir, "pp2", bpb, written, _prompts())
    slot_bytes = -(-(DiskStore.header_size(BS) + bpb // 2) // 4096) * 4096  # (a TP=2 rank's slot)
    assert json.loads((written / f"{RANK_FILES['pp2'][0]}.json").read_text())["slot_bytes"] == slot_bytes
    moved = tmp_path / "moved"
    moved.mkdir()
    for pp_stem, tp_stem in zip(RANK_FILES["pp2"], RANK_FILES["tp2"], strict=True):
        for ext in ("bin", "json"):
            shutil.copy(written / f"{pp_stem}.{ext}", moved / f"{tp_stem}.{ext}")
    outs, s, ranks = _with_tiers(llama_dir, "tp2", bpb, moved, _prompts()[:1])
    assert outs == want[:1]
    assert s.kv_disk_hit_tokens == 0 and [r["disk_read"] for r in ranks] == [0, 0]
    # and TP=2 over the PP=2 directory itself: other names, none of its files is read
    outs, s, _ = _with_tiers(llama_dir, "tp2", bpb, written, _prompts()[:1])
    assert s.kv_disk_hit_tokens == 0 and outs == want[:1]


def test_pp2_swaps_a_preempted_request_through_each_stages_host_tier(llama_dir):
    """Four prompts on 14 device blocks preempt each other: under PP=2 each stage copies its layers'
    part of the swapped-out blocks to its own host tier and back, with the tokens of one process
    with swap space."""
    rng = random.Random(11)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]} for n in (5, 19, 41, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = dict(max_model_len=112, block_size=BS, num_gpu_blocks_override=14, admission_reserve_tokens=0)
    one = LLM(llama_dir, swap_space=0.001, **options)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    one.shutdown()
    llm = LLM(llama_dir, pipeline_parallel_size=2, kv_offload_cpu_gb=0.001, **options)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want and llm.stats().num_swap_outs > 0
        ranks = llm.core.runner.tier_counts_by_rank()
        assert ranks[0]["host_stored"] == ranks[1]["host_stored"] > 0
        assert ranks[0]["host_loaded"] == ranks[1]["host_loaded"] > 0
        kv = llm.core.kv
        assert kv.host.counts.swapped_in == kv.host.counts.swapped_out > 0
        assert kv.pool.num_free == kv.pool.num_usable
    finally:
        llm.shutdown()
