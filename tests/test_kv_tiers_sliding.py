"""The KV cache tiers with sliding-window models (several KV groups, engine/kv_layout.py): each
group's blocks move down the tiers under their own key and digest; a prefix found in the tiers
takes every block of a full-attention group and only the last window's blocks of a sliding one."""

from __future__ import annotations

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.kv_disk_store import chain_digest, group_digest

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BS = 8
OPTS = dict(max_model_len=128, block_size=BS, num_gpu_blocks_override=56, admission_reserve_tokens=0,
            max_num_batched_tokens=32)  # fmt: skip


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[2] + [rng.randrange(3, 500) for _ in range(63)] for _ in range(4)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_group_digests_differ_and_group_0_is_the_blocks_own():
    d = chain_digest(None, [1] * BS, None)
    assert group_digest(d, 0) == d
    assert len({group_digest(d, g) for g in range(6)}) == 6


def test_sliding_window_model_through_host_and_disk_tiers(model_dirs, tmp_path):
    """Gemma 3 (five window-16 layers, one global: six KV groups) under eviction pressure: with a
    host and a disk tier its tokens equal the engine's without tiers, blocks come back from both;
    a restarted engine loads the first prompt's 7 full-attention blocks and, of each of the five
    sliding groups, only the 2 blocks of the window before the prefix's end (7 + 5 x 2 = 17)."""
    model = model_dirs["gemma3"]
    prompts = _prompts()
    sequence = prompts + prompts[::-1]
    plain = LLM(model, **OPTS)
    want = _run(plain, sequence)
    bpb = plain.core.runner.bytes_per_block
    assert plain.core.runner.kv_layout.num_groups == 6
    plain.shutdown()
    tiers = dict(kv_offload_cpu_gb=8 * bpb / (1 << 30), kv_offload_disk_path=str(tmp_path),
                 kv_offload_disk_gb=400 * bpb / (1 << 30))  # fmt: skip
    llm = LLM(model, **tiers, **OPTS)
    assert _run(llm, sequence) == want
    s = llm.stats()
    assert s.kv_offload_loaded_blocks > 0 and s.kv_disk_loaded_blocks > 0 and s.kv_disk_errors == 0
    llm.shutdown()
    again = LLM(model, **tiers, **OPTS)
    assert _run(again, prompts[:1]) == want[:1]
    s = again.stats()
    assert s.kv_disk_hit_tokens == 7 * BS and s.kv_disk_loaded_blocks == 7 + 5 * 2
    again.shutdown()
