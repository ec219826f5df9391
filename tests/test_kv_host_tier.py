"""The prefix cache's host tier (engine/kv_host_tier.py): blocks evicted from the device move to
host memory, and a prefix found there is loaded back instead of recomputed."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError
from llmserve.engine.block_pool import BlockKey
from llmserve.engine.kv_host_tier import HostTier

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _key(i: int) -> BlockKey:
    return BlockKey(None, (i,), None)


def test_host_tier_is_lru_and_keeps_pinned_blocks():
    tier = HostTier(2)
    a, b = tier.store(_key(1)), tier.store(_key(2))
    assert {a, b} == {0, 1} and tier.store(_key(1)) is None  # already there: nothing to write
    assert tier.lookup(_key(1)) == a  # now the most recent: key 2 goes first
    c = tier.store(_key(3))
    assert c == b and tier.lookup(_key(2)) is None
    tier.pin(a)
    tier.pin(c)
    assert tier.store(_key(4)) is None and tier.counts.dropped == 1  # every block pinned this step
    tier.unpin_all()
    assert tier.store(_key(4)) == a  # key 1 was the least recent
    tier.clear()
    assert tier.lookup(_key(4)) is None and len(tier.free) == 2 and tier.counts.stored == 4


def _prompts() -> tuple[list[int], list[list[int]]]:
    rng = random.Random(5)
    shared = [1] + [rng.randrange(3, 500) for _ in range(63)]
    others = [[1] + [rng.randrange(3, 500) for _ in range(60)] for _ in range(2)]
    return shared, others


def test_evicted_prefix_comes_back_from_host_memory(llama_dir):
    """A 64-token prompt, then two others that take every device block (evicting it), then the
    first again: its blocks are loaded from the host tier, and every output equals the engine's
    without the tier (which recomputes) and transformers'."""
    from conftest import hf_greedy

    shared, others = _prompts()
    options = dict(max_model_len=128, block_size=8, num_gpu_blocks_override=20, admission_reserve_tokens=0)
    tiered = LLM(llama_dir, kv_offload_cpu_gb=0.001, **options)
    plain = LLM(llama_dir, **options)
    outs, last_hits = {}, {}
    for name, llm in (("tiered", tiered), ("plain", plain)):
        runs = [llm.generate([{"prompt_token_ids": shared}], GREEDY, use_tqdm=False)]
        for other in others:
            runs.append(llm.generate([{"prompt_token_ids": other}], GREEDY, use_tqdm=False))
        before = llm.stats().prefix_cache_hits
        runs.append(llm.generate([{"prompt_token_ids": shared}], GREEDY, use_tqdm=False))
        last_hits[name] = llm.stats().prefix_cache_hits - before
        outs[name] = [r[0].outputs[0].token_ids for r in runs]
    assert outs["tiered"] == outs["plain"]
    assert outs["tiered"][0] == outs["tiered"][-1] == hf_greedy(llama_dir, [shared], 8)[0]
    stats = tiered.stats()
    assert stats.kv_offload_stored_blocks > 0 and stats.kv_offload_loaded_blocks > 0
    # every full block of the repeat came from a cache (device or host), and some only from the host,
    # where the engine without the tier recomputed them
    assert last_hits["tiered"] == (len(shared) - 1) // 8 * 8 > last_hits["plain"]
    assert stats.kv_offload_hit_tokens == 8 * stats.kv_offload_loaded_blocks > 0


def test_tier_copies_are_bit_exact(llama_dir):
    llm = LLM(llama_dir, max_model_len=64, block_size=8, kv_offload_cpu_gb=0.001)
    runner = llm.core.runner
    for cache in runner.kv_caches:
        cache[:, 3] = torch.randn_like(cache[:, 3])
    before = [c[:, 3].clone() for c in runner.kv_caches]
    runner._tier_copy([(3, 1)], to_host=True)
    runner._tier_copy([(1, 5)], to_host=False)
    assert all(torch.equal(c[:, 5], b) for c, b in zip(runner.kv_caches, before))


def test_host_tier_refusals(model_dirs, llama_dir):
    with pytest.raises(ConfigError, match="prefix caching"):
        LLM(llama_dir, max_model_len=64, kv_offload_cpu_gb=0.001, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="kv_offload_cpu_gb"):
        LLM(llama_dir, max_model_len=64, kv_offload_cpu_gb=-1)
