"""The last layer on the sampling rows alone (`LlamaModel.forward(..., sampled)`,
`ModelRunner.samples_only`): a step's rows that do not sample (prompt chunks) need their keys
and values in every layer, but no hidden state out of the last one. The reference is the plain
forward, whose rows the LM head then picks."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy, mixed_batch

from llmserve import LLM, SamplingParams

pytestmark = pytest.mark.unit


def _batch(runner, rng: random.Random, samples: tuple[bool, ...]):
    """Decodes, a fresh prompt, chunks after cached tokens (one of which stops short of its end),
    each row sampling or not as `samples` says."""
    return mixed_batch(runner, rng, ((13, 1), (0, 21), (8, 3), (30, 1), (16, 9), (0, 5)), samples)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("samples", [(True, True, True, True, False, True), (True,) * 6, (False,) * 6],
                         ids=["some", "all", "none"])  # fmt: skip
def test_the_sampling_rows_alone_equal_the_plain_forwards_rows(model_dirs, family, samples):
    llm = LLM(model_dirs[family], max_model_len=64, block_size=8, dtype="float32")
    runner = llm.core.runner
    rng = random.Random(5)
    for layer_cache in runner.kv_caches:  # the context the cached prefixes and decodes attend to
        layer_cache.copy_(torch.randn_like(layer_cache))
    saved = [c.clone() for c in runner.kv_caches]
    batch = _batch(runner, rng, samples)
    assert runner.samples_only(batch)  # (chunks: rows that do not sample, whatever `samples` says)
    with torch.inference_mode():
        input_ids, positions, meta = batch.to_device(runner.device)
        want = runner.model(input_ids, positions, meta)[batch.logits_indices]
        want_caches = [c.clone() for c in runner.kv_caches]
        for cache, old in zip(runner.kv_caches, saved):
            cache.copy_(old)
        got = runner.model(input_ids, positions, meta, batch.sampled_rows(meta, runner.device))
    assert got.shape == want.shape == (sum(samples), runner.arch.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for cache, expected in zip(runner.kv_caches, want_caches):  # every row's K/V, in every layer
        torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_long_prompts_in_chunks_beside_decodes_match_transformers(llama_dir):
    """The engine with steps whose last layer runs on the sampling rows (chunks that stop short of
    their prompt's end, chunks that finish it, decodes beside them): greedy tokens equal
    transformers', and a LoRA-free engine takes that path in those steps."""
    rng = random.Random(17)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (70, 9, 45, 33)]
    want = hf_greedy(llama_dir, prompts, 10)
    llm = LLM(llama_dir, max_model_len=128, block_size=8, max_num_batched_tokens=32)
    runner, taken = llm.core.runner, []
    samples_only = runner.samples_only
    runner.samples_only = lambda batch: taken.append(samples_only(batch)) or taken[-1]
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in out] == want
    assert True in taken and False in taken  # steps with chunks took it; decode-only steps did not
