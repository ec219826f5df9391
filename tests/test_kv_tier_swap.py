"""Swap preemption through the prefix cache's host tier (engine/kv_host_tier.py): with the tier on,
a preempted request's blocks (its partial last one too) are copied to host blocks taken out of the
tier's LRU, and back on resume."""

from __future__ import annotations

import random

import pytest
from conftest import assert_no_leak
from test_scheduler import make_request, run_to_end, step

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, SchedulerConfig
from llmserve.engine.block_pool import BlockKey
from llmserve.engine.kv_cache_manager import KVCacheManager
from llmserve.engine.kv_host_tier import HostTier
from llmserve.engine.request import RequestStatus
from llmserve.engine.scheduler import Scheduler

pytestmark = pytest.mark.unit


def _key(i: int) -> BlockKey:
    return BlockKey(None, (i,), None)


def test_reserve_takes_free_blocks_then_the_lru_and_release_gives_them_back():
    tier = HostTier(3)
    a, b = tier.store(_key(1)), tier.store(_key(2))
    tier.pin(a)  # (a load of this step)
    taken = tier.reserve(2)
    assert taken == [(2, None), (b, _key(2))]  # the free block, then the least recent unpinned one
    assert tier.reserve(1) is None and tier.num_reserved == 2  # key 1's block is pinned: nothing taken
    tier.clear()  # (a prefix cache reset keeps the reserved blocks)
    assert sorted(tier.free) == [a] and tier.num_reserved == 2
    tier.release_after_step([2])
    assert tier.num_reserved == 2  # until the step's copies are taken
    tier.unpin_all()
    tier.release([b])
    assert tier.num_reserved == 0 and sorted(tier.free) == [0, 1, 2]
    assert (tier.counts.swapped_out, tier.counts.swapped_in) == (2, 1)


def _scheduler(host_blocks: int) -> Scheduler:
    kv = KVCacheManager(6, 4, True, num_host_blocks=host_blocks)
    sched = Scheduler(SchedulerConfig(8, 64, True, 24, admission_reserve_tokens=0), kv, swap_enabled=kv.swap_enabled)
    sched.watermark = 0
    return sched


def test_a_preempted_request_swaps_through_the_host_tier():
    """Prompts of 8, 8 and 6 tokens on 6 blocks of 4: the last is swapped out (its full block and its
    partial one copied to the host tier with the tier's offloads, none to swap space) and back in
    (with the tier's loads)."""
    sched = _scheduler(host_blocks=8)
    for i, (rid, n) in enumerate((("a", 8), ("b", 8), ("c", 6))):
        sched.add_request(make_request(rid, prompt_len=n, max_tokens=6, arrival=i))
    step(sched)
    device_blocks = list(sched.kv.block_table("c"))
    out, _ = step(sched)
    victim = sched.waiting[0]
    assert victim.request_id == "c" and victim.status == RequestStatus.SWAPPED and victim.num_computed_tokens == 6
    held = sched.kv.req_cpu_blocks[victim.request_id]  # 6 tokens: a full block and a partial one
    assert not out.blocks_to_swap_out and out.kv_offload[:2] == list(zip(device_blocks, held))
    assert sched.kv.num_swapped_blocks == 2
    # its full block, cached and freed on the device, then handed to "a": also kept as a prefix block
    assert out.kv_offload[2:] == [(device_blocks[0], 2)] and sched.kv.host.entries
    swap_in = None
    while sched.has_unfinished() and swap_in is None:
        out, _ = step(sched)
        swap_in = [p for p in out.kv_load if p[0] in held] or None
    assert [h for h, _ in swap_in] == held and not out.blocks_to_swap_in
    assert sched.kv.block_table(victim.request_id) == [d for _, d in swap_in]
    assert run_to_end(sched) == {"c": "length"}  # ("a" and "b" ended while it was out)
    step(sched)
    kv = sched.kv
    assert kv.pool.num_used == 0 and kv.num_swapped_blocks == 0
    assert len(kv.host.free) + len(kv.host.entries) == kv.host.num_blocks  # every host block back in the tier


def test_abort_of_a_swapped_out_request_frees_its_host_copies():
    sched = _scheduler(host_blocks=8)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, prompt_len=8, max_tokens=6, arrival=i))
    step(sched)
    step(sched)
    victim = sched.waiting[0]
    assert victim.status == RequestStatus.SWAPPED and sched.kv.num_swapped_blocks == 2
    assert sched.abort_requests([victim.request_id]) == [victim.request_id]
    assert sched.kv.num_swapped_blocks == 0 and victim.request_id not in sched.kv.req_cpu_blocks
    run_to_end(sched)
    assert sched.kv.pool.num_used == 0 and len(sched.kv.host.free) + len(sched.kv.host.entries) == 8


def test_a_host_tier_too_small_recomputes():
    sched = _scheduler(host_blocks=1)  # fewer than the victim's 2 blocks
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, prompt_len=8, max_tokens=6, arrival=i))
    step(sched)
    step(sched)
    assert sched.waiting[0].status == RequestStatus.PREEMPTED and sched.num_swap_outs == 0
    assert run_to_end(sched) == {"a": "length", "b": "length", "c": "length"}
    assert sched.kv.num_swapped_blocks == 0


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[dict]:
    rng = random.Random(11)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]} for n in (5, 19, 41, 70)]


def test_swap_through_the_host_tier_keeps_greedy_tokens(llama_dir, tmp_path):
    """Four prompts on 14 blocks of 8 tokens preempt each other, twice: swapped through the host tier
    (alone, and of 7 blocks above a disk tier: the second time the swaps take the blocks of cached
    prefixes, which move down to disk) they give the tokens of swap space; every device and host block
    is back at the end."""
    options = dict(max_model_len=112, block_size=8, num_gpu_blocks_override=14, admission_reserve_tokens=0)
    engines = {
        "swap space": dict(swap_space=0.001),
        "host tier": dict(kv_offload_cpu_gb=0.001),
        "host tier and disk": dict(
            kv_offload_cpu_gb=0.00003, kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gb=0.002
        ),  # fmt: skip
    }
    tokens = {}
    for name, tiers in engines.items():
        llm = LLM(llama_dir, **options, **tiers)
        runs = [llm.generate(_prompts(), GREEDY, use_tqdm=False) for _ in range(2)]
        tokens[name] = [[o.outputs[0].token_ids for o in outs] for outs in runs]
        assert tokens[name][0] == tokens[name][1], name
        stats = llm.stats()
        assert stats.num_swap_outs > 0, name
        kv = llm.core.kv
        if kv.host is not None:
            assert kv.host.counts.swapped_out > 0 and kv.host.counts.swapped_in == kv.host.counts.swapped_out
            assert len(kv.host.free) + len(kv.host.entries) == kv.host.num_blocks, name
        if kv.disk is not None:
            assert kv.host.num_blocks == 7 and kv.disk.counts.stored > 0
        assert_no_leak(llm)
        assert kv.pool.num_free == kv.pool.num_usable, name
        llm.shutdown()
    assert tokens["host tier"] == tokens["swap space"] == tokens["host tier and disk"]


def test_swap_through_the_host_tier_with_sliding_windows(model_dirs):
    """Mistral's sliding-window layers hold only their window's blocks: a swapped-out request's
    released entries take no host block, and the tokens are those of swap space."""
    options = dict(max_model_len=112, block_size=8, num_gpu_blocks_override=8, admission_reserve_tokens=0,
                   enable_chunked_prefill=True, max_num_batched_tokens=16)  # fmt: skip
    tokens = {}
    for name, tiers in (("swap space", dict(swap_space=0.001)), ("host tier", dict(kv_offload_cpu_gb=0.001))):
        llm = LLM(model_dirs["mistral"], **options, **tiers)
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
        assert llm.stats().num_swap_outs > 0, name
        assert_no_leak(llm)
        llm.shutdown()
    assert tokens["host tier"] == tokens["swap space"]


def test_swap_space_and_the_host_tier_do_not_combine(llama_dir):
    with pytest.raises(ConfigError, match="swap_space"):
        LLM(llama_dir, max_model_len=64, kv_offload_cpu_gb=0.001, swap_space=0.001)


# -- sleep ---------------------------------------------------------------------------------------
def test_a_level_1_sleep_moves_the_prefix_cache_down_the_tiers(llama_dir, tmp_path):
    """A 64-token prompt's 8 cached blocks (block 8 holds generated tokens) move, at a level-1 sleep,
    into a host tier of 5 blocks and a disk tier under it: after the wake the prompt's 7 full blocks
    are all hits (5 from host memory, 2 from disk) with the same tokens; a level-2 sleep resets every
    tier (its wake may read new weights)."""
    rng = random.Random(3)
    prompt = [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(63)]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(llama_dir, max_model_len=128, block_size=8, kv_offload_cpu_gb=0.00002,
              kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gb=0.002)  # fmt: skip
    assert llm.core.kv.host.num_blocks == 5
    first = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for level, hit_tokens in ((1, 56), (2, 0)):
        llm.sleep(level)
        kv = llm.core.kv
        assert kv.pool.cached == {} and len(kv.host.entries) == (5 if level == 1 else 0)
        llm.wake_up()
        before = llm.stats()
        again = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        after = llm.stats()
        assert again == first
        assert after.prefix_cache_hits - before.prefix_cache_hits == hit_tokens, level
        if level == 1:
            assert after.kv_offload_hit_tokens - before.kv_offload_hit_tokens == 40
            assert after.kv_disk_hit_tokens - before.kv_disk_hit_tokens == 16
    assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.integration
def test_tp2_swaps_through_each_ranks_host_tier_and_sleeps_into_it(llama_dir):
    """Two ranks (gloo, CPU): each copies its shard of a swapped-out request's blocks to its own host
    tier and back (the tokens of one rank with swap space), and a level-1 sleep moves each rank's
    shard of the cached prefixes into it (every full block of the repeated prompt is a hit)."""
    options = dict(max_model_len=112, block_size=8, num_gpu_blocks_override=14, admission_reserve_tokens=0)
    one = LLM(llama_dir, swap_space=0.001, **options)
    want = [o.outputs[0].token_ids for o in one.generate(_prompts(), GREEDY, use_tqdm=False)]
    one.shutdown()
    llm = LLM(llama_dir, tensor_parallel_size=2, kv_offload_cpu_gb=0.001, **options)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
        assert got == want and llm.stats().num_swap_outs > 0
        assert_no_leak(llm)
        ranks = llm.core.runner.tier_counts_by_rank()
        assert ranks[0]["host_stored"] == ranks[1]["host_stored"] > 0
        assert ranks[0]["host_loaded"] == ranks[1]["host_loaded"] > 0
        prompt = _prompts()[3]  # 70 tokens: 8 full blocks
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.sleep(1)
        llm.wake_up()
        before = llm.stats().prefix_cache_hits
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
        assert llm.stats().prefix_cache_hits - before == 64
    finally:
        llm.shutdown()
