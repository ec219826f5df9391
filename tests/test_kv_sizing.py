"""KV cache sizing arithmetic (llmserve/engine/kv_sizing.py), apart from the profile run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve.config import EngineArgs
from llmserve.engine.kv_sizing import (
    DEFAULT_CPU_KV_BYTES,
    bytes_per_block,
    cpu_num_blocks,
    graph_memory_reserve,
    kv_budget,
)

pytestmark = pytest.mark.unit


def test_bytes_per_block_counts_keys_and_values_of_every_layer():
    arch = EngineArgs(device="cpu").create_engine_config().model_config.arch
    want = 2 * arch.num_layers * 16 * arch.num_kv_heads * arch.head_dim
    assert bytes_per_block(arch, 16, torch.bfloat16) == 2 * want
    assert bytes_per_block(arch, 16, torch.float8_e4m3fn) == want  # an FP8 cache holds twice the tokens


def test_cpu_blocks_fit_the_budget_but_hold_one_whole_sequence():
    assert cpu_num_blocks(1 << 20, 16, 2048, 256) == DEFAULT_CPU_KV_BYTES >> 20  # the budget binds
    assert cpu_num_blocks(1 << 20, 16, 64, 2) == 2 * 4 + 1  # no more than every sequence can use
    assert cpu_num_blocks(64 << 20, 16, 8192, 256) == 512  # one sequence of 8,192 tokens, over budget


def test_the_gpu_budget_leaves_out_activations_graphs_sampler_and_other_memory():
    config = EngineArgs(device="cpu").create_engine_config()
    gib = 1 << 30
    eager = dataclasses.replace(config, enforce_eager=True)
    sc = config.scheduler_config
    sampler = 8 * sc.max_num_seqs * 1000 * 4
    got = kv_budget(eager, total=100 * gib, peak=30 * gib, kv_bytes=2 * gib, weights=16 * gib,
                    non_torch=gib, vocab_size=1000).kv_bytes  # fmt: skip
    assert got == int(100 * gib * config.cache_config.gpu_memory_utilization) - 28 * gib - gib - sampler
    graphs = dataclasses.replace(config, enforce_eager=False, max_mixed_graph_tokens=sc.max_num_batched_tokens)
    assert graph_memory_reserve(graphs, 12 * gib, sc.max_num_batched_tokens) == 13 * gib
    assert kv_budget(graphs, 100 * gib, 30 * gib, 2 * gib, 16 * gib, gib, 1000).kv_bytes == got - 13 * gib


def test_the_budget_s_parts_add_up_and_are_named():
    """The parts the engine logs (and names in its error when no block fits) are the budget's arithmetic."""
    gib = 1 << 30
    config = EngineArgs(device="cpu", gpu_memory_utilization=0.3).create_engine_config()
    parts = kv_budget(config, total=80 * gib, peak=30 * gib, kv_bytes=2 * gib, weights=16 * gib, non_torch=gib,
                      vocab_size=1000)  # fmt: skip
    assert parts.kv_bytes == int(80 * gib * 0.3) - 16 * gib - 12 * gib - gib - parts.sampler - parts.graphs
    assert parts.activations == 12 * gib and parts.allowed == int(80 * gib * 0.3)
    text = parts.describe()
    for word in ("weights 17.18", "activations 12.88", "outside torch's allocator 1.07", "KV cache"):
        assert word in text, text
