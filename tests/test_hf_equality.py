"""Greedy output must equal transformers' generate() token for token (float32)."""

from __future__ import annotations

import random

import pytest
from conftest import assert_no_leak, hf_greedy

from llmserve import LLM, SamplingParams

pytestmark = pytest.mark.unit

MAX_NEW = 24


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in (5, 19, 41, 70)]


# name -> engine options; each must reproduce HF exactly
ENGINE_VARIANTS = {
    "prefix-cache-on": dict(enable_prefix_caching=True),
    "prefix-cache-off": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    "no-chunked-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
    # admitted without keeping the decodes' growth free (admission_reserve_tokens=0), so they preempt
    "preempt-recompute": dict(block_size=8, num_gpu_blocks_override=14, swap_space=0, admission_reserve_tokens=0),
    "preempt-swap": dict(block_size=8, num_gpu_blocks_override=14, swap_space=0.001, admission_reserve_tokens=0),
}


# the preempt variants' block ids for families with sliding windows, in chunks of 16 tokens: their
# sequences hold only a window's blocks in sliding layers (engine/kv_layout.py; gemma3's six
# layers are six KV groups of one layer, so a block id is a sixth of llama's), block 0 reserved
SLIDING_BLOCKS = {"mistral": 8, "gemma3": 36}


@pytest.fixture(scope="module")
def references(model_dirs):
    return {family: hf_greedy(path, _prompts(i), MAX_NEW) for i, (family, path) in enumerate(model_dirs.items())}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_greedy_matches_transformers(model_dirs, references, family, variant):
    options = dict(ENGINE_VARIANTS[variant])
    if variant.startswith("preempt") and family in SLIDING_BLOCKS:
        options.update(num_gpu_blocks_override=SLIDING_BLOCKS[family], enable_chunked_prefill=True,
                       max_num_batched_tokens=16)  # fmt: skip
    llm = LLM(model_dirs[family], max_model_len=112, **options)
    index = list(model_dirs).index(family)
    prompts = [{"prompt_token_ids": p} for p in _prompts(index)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == references[family]
    if variant.startswith("preempt"):
        assert llm.stats().num_preemptions > 0, "the KV budget was meant to force preemption"
    if variant == "preempt-swap":
        assert llm.stats().num_swap_outs > 0, "preemption was meant to swap"
    assert_no_leak(llm)
