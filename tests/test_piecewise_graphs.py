"""Piecewise CUDA graphs for steps with prefill tokens (`engine/cuda_graphs.PiecewiseGraphs`).

On the GPU the pieces between attention calls replay captured graphs; here (no GPU) the
same pieces run eagerly through the same static buffers, with the same padding. That is
the path checked: its hidden states against the model's plain forward, and its greedy
tokens inside the whole engine against transformers. `tests/gpu/test_gpu_engine.py` checks
the captured graphs on a GPU (`pytest -m gpu`).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy, mixed_batch

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.engine.cuda_graphs import PiecewiseGraphs, mixed_capture_sizes
from llmserve.engine.kv_sizing import graph_memory_reserve

pytestmark = pytest.mark.unit


def test_capture_sizes_cover_every_count_up_to_the_top():
    sizes = mixed_capture_sizes(1024)
    assert sizes[:3] == [16, 32, 48] and sizes[-1] == 1024 and sizes == sorted(set(sizes))
    assert all(b - a <= 64 for a, b in zip(sizes, sizes[1:]))
    assert mixed_capture_sizes(600)[-1] == 600 and mixed_capture_sizes(10) == [10]
    assert mixed_capture_sizes(0) == []


def _mixed_batch(runner, rng: random.Random):
    """A cached prefix + chunk, a whole prompt, and two decodes: 3 + 21 + 1 + 1 tokens."""
    return mixed_batch(runner, rng, ((8, 3), (0, 21), (13, 1), (30, 1)))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_pieces_through_padded_buffers_equal_the_plain_forward(model_dirs, family):
    llm = LLM(model_dirs[family], max_model_len=64, block_size=8, dtype="float32")
    runner = llm.core.runner
    rng = random.Random(3)
    for layer_cache in runner.kv_caches:  # context the prefix and decode rows attend to
        layer_cache.copy_(torch.randn_like(layer_cache))
    caches = [c.clone() for c in runner.kv_caches]
    batch = _mixed_batch(runner, rng)
    with torch.inference_mode():
        input_ids, positions, meta = batch.to_device(runner.device)
        want = runner.model(input_ids, positions, meta)
        want_caches = [c.clone() for c in runner.kv_caches]
        for cache, saved in zip(runner.kv_caches, caches):
            cache.copy_(saved)
        graphs = PiecewiseGraphs(runner.model, 48, runner.device)
        assert graphs.padded_size(len(batch.input_ids)) == 32  # 26 tokens, 6 rows of padding
        graphs.positions.fill_(40)  # stale rows from an earlier step must not matter
        got = graphs.run(input_ids, positions, meta)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for cache, expected in zip(runner.kv_caches, want_caches):  # the same K/V written, and no more
        torch.testing.assert_close(cache, expected, rtol=1e-5, atol=1e-5)
    assert graphs.graphs == {}  # nothing captured on CPU: the pieces ran eagerly


def test_engine_on_the_piecewise_path_matches_transformers(llama_dir):
    """Chunked prefill mixed with decodes, every step with a prefill token through the
    pieces: greedy tokens equal transformers'."""
    rng = random.Random(11)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (4, 23, 40)]
    want = hf_greedy(llama_dir, prompts, 8)
    llm = LLM(llama_dir, max_model_len=96, block_size=8, max_num_batched_tokens=24)
    runner = llm.core.runner
    runner.mixed_graphs = PiecewiseGraphs(runner.model, 24, runner.device)
    calls = []
    run = runner.mixed_graphs.run
    runner.mixed_graphs.run = lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len(calls) >= 3 and max(calls) == 24  # the chunks went through the pieces


def test_mixed_graph_tokens_flag():
    assert EngineArgs(device="cpu").create_engine_config().max_mixed_graph_tokens == 0  # no graphs on CPU
    with pytest.raises(ConfigError, match="max_mixed_graph_tokens"):
        EngineArgs(device="cpu", max_mixed_graph_tokens=-1).create_engine_config()


def test_graph_memory_comes_out_of_the_kv_budget():
    config = EngineArgs(device="cpu").create_engine_config()
    assert graph_memory_reserve(config, activations=16 << 30, num_tokens=16384) == 0  # eager: no graphs
    config.enforce_eager, config.max_mixed_graph_tokens = False, 1024
    assert graph_memory_reserve(config, activations=16 << 30, num_tokens=16384) == (1 << 30) + (1 << 30)
    config.max_mixed_graph_tokens = 0
    assert graph_memory_reserve(config, activations=16 << 30, num_tokens=16384) == 1 << 30
    config.max_mixed_graph_tokens = 4096  # beyond the step budget: capped by it
    assert graph_memory_reserve(config, activations=3 << 30, num_tokens=2048) == (1 << 30) + (3 << 30)
