"""The last layer on the sampling rows alone, on the GPU (was scripts/gpu/sampled_rows_check.py).

1. The model's forward with `SampledRows` against its plain forward's sampling rows, on a mixed batch
   that takes every attention path of the Triton backend (decodes, a fresh prompt for SDPA, one for the
   fresh-prompt kernel, a later chunk, a short prompt, a chunk that does not sample), in float32 and
   bfloat16 on a random model of the 8B's width: the hidden rows within rounding, every layer's KV
   cache equal.
2. The engine's greedy tokens with the path and with it turned off, bfloat16, prompts of 64 to 3,000
   tokens in chunks of 1,536: every first token equal (later ones may part after a bf16 near-tie on a
   random model: 128 of 144 equal on an H100, 2026-12-05).
"""

from __future__ import annotations

import random

import pytest
import torch
from gpu_utils import free_device_memory  # noqa: F401

from llmserve import LLM, SamplingParams
from llmserve.engine.input_builder import RowInput
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=8192)  # fmt: skip
# (first new position, new tokens, samples): decodes, a fresh prompt for SDPA (2,048+), one for the
# fresh kernel (512-2,047), a chunk after 3,000 cached tokens, a short prompt, a chunk stopping short
ROWS = ((700, 1, True), (0, 2304, True), (0, 900, True), (3000, 1200, True), (0, 37, True), (1500, 600, False),
        (4000, 1, True))  # fmt: skip


@pytest.fixture(scope="module")
def model_8b_width(tmp_path_factory) -> str:
    return str(make_random_model(tmp_path_factory.mktemp("sampled_rows") / "m", "llama", vocab_size=32000,
                                 config_only=True, **SHAPE))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_rows_forward_equals_the_plain_forward(model_8b_width, dtype):
    # a cache of a set size (1,024 blocks): the check holds three copies of it
    llm = LLM(model_8b_width, device="cuda", dtype=dtype, max_model_len=8192, block_size=16,
              num_gpu_blocks_override=1024, load_format="dummy", enforce_eager=True)  # fmt: skip
    runner = llm.core.runner
    rng = random.Random(7)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for cache in runner.kv_caches:  # the cached prefixes' and decodes' context
        cache.copy_((torch.randn(cache.shape, device="cuda", generator=gen) * 0.5).to(cache.dtype))
    saved = [c.clone() for c in runner.kv_caches]
    items, next_block = [], 1
    for start, count, samples in ROWS:
        end = start + count
        table = list(range(next_block, next_block + -(-end // 16)))
        next_block += len(table)
        items.append(
            RowInput(f"r{len(items)}", table, start, count, [rng.randrange(3, 500) for _ in range(end)], samples)
        )
    batch = runner.inputs.build(items)
    with torch.inference_mode():
        input_ids, positions, meta = batch.to_device(runner.device)
        want = runner.model(input_ids, positions, meta)[batch.logits_indices].float()
        want_caches = [c.clone() for c in runner.kv_caches]
        for cache, old in zip(runner.kv_caches, saved):
            cache.copy_(old)
        got = runner.model(input_ids, positions, meta, batch.sampled_rows(meta, runner.device)).float()
    for cache, want_cache in zip(runner.kv_caches, want_caches):
        assert torch.equal(cache, want_cache)
    # float32: 7.7e-6 with values up to 4.08; bfloat16: one ulp (0.0156 at 4) on an H100, 2026-12-05
    ulps = 1e-5 if dtype == "float32" else 2 * 2**-7
    assert (got - want).abs().max().item() <= ulps * max(1.0, want.abs().max().item())


def test_engine_first_tokens_equal_with_and_without_the_path(model_8b_width):
    rng = random.Random(11)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (600, 1800, 3000, 2400, 64, 1100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model_8b_width, device="cuda", dtype="bfloat16", max_model_len=8192, num_gpu_blocks_override=4096,
              load_format="dummy", max_num_batched_tokens=1536, seed=3)  # fmt: skip
    runner, taken = llm.core.runner, []
    samples_only = runner.samples_only
    runner.samples_only = lambda batch: taken.append(samples_only(batch)) or taken[-1]
    with_path = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]  # fmt: skip
    runner.samples_only = lambda batch: False
    without = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]  # fmt: skip
    assert sum(taken) > 0, "no step took the path"
    assert [x[0] for x in with_path] == [y[0] for y in without]
