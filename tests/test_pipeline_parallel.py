"""Pipeline parallelism on CPU: stages in real processes, hidden states over gloo send/recv.

PP=2 and TP=2 x PP=2 must give the single process's greedy tokens (and its logprobs within
float32 rounding) with prefix caching and chunked prefill on; a stage worker that dies must
fail the engine at once: the request ends with the cause and health turns false.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from server_utils import children

from llmserve import LLM, AsyncEngine, EngineArgs, SamplingParams
from llmserve.config import ConfigError
from llmserve.engine.pp_stages import RankPlace, stage_slots
from llmserve.engine.tp_workers import WorkerDiedError
from llmserve.errors import EngineDeadError
from llmserve.model.pipeline import PipelineStage, split_layers, stage_keeps
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.integration

OPTS = dict(max_model_len=128, max_num_batched_tokens=32, enable_prefix_caching=True, enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory) -> str:
    """Three layers: PP=2 splits them 2 + 1 (uneven), the head untied (llama)."""
    return str(make_random_model(tmp_path_factory.mktemp("pp") / "llama3", "llama", seed=1, num_hidden_layers=3))


def _prompts() -> list[dict]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(20)]  # a shared prefix: later prompts hit the cache
    return [{"prompt_token_ids": [1] + shared + [rng.randrange(3, 500) for _ in range(n)]} for n in (4, 23, 40, 71)]


def _run(model: str, **kwargs):
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=1)
    again = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)  # (prompt logprobs take no cache hit)
    with LLM(model, **OPTS, **kwargs) as llm:
        outs = llm.generate(_prompts(), params, use_tqdm=False)  # chunked prompts beside decodes
        outs += llm.generate(_prompts(), again, use_tqdm=False)  # found in the prefix cache
        stats = llm.stats()
        assert stats.num_blocks_used == 0
    return outs, stats


def _assert_same(single, split) -> None:
    for a, b in zip(single, split, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        prompt_a, prompt_b = (a.prompt_logprobs or [None])[1:], (b.prompt_logprobs or [None])[1:]
        assert len(prompt_a) == len(prompt_b)
        for la, lb in zip([*a.outputs[0].logprobs, *prompt_a], [*b.outputs[0].logprobs, *prompt_b]):
            assert la.keys() == lb.keys()
            for token in la:
                assert la[token].logprob == pytest.approx(lb[token].logprob, abs=2e-4)


def test_layer_split_and_ranks():
    assert split_layers(3, 2) == [(0, 2), (2, 3)]
    assert split_layers(32, 3) == [(0, 11), (11, 22), (22, 32)]
    # rank 0 (the engine core) is tensor rank 0 of the last stage; the first stage's ranks come last
    places = [RankPlace(r, tp_size=2, pp_size=2) for r in range(4)]
    assert [(p.stage, p.tp_rank) for p in places] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    assert places[2].rank_of(1) == 0 and places[3].rank_of(1) == 1
    # a stage holds the KV cache slots of its own layers only
    assert stage_slots(tuple(range(5)), PipelineStage(1, 2, 3, 5)) == [3, 4]
    first, last = PipelineStage(0, 2, 0, 2), PipelineStage(1, 2, 2, 3)
    assert stage_keeps("model.layers.1.mlp.down_proj.weight", first, False)
    assert not stage_keeps("model.layers.2.mlp.down_proj.weight", first, False)
    assert stage_keeps("model.embed_tokens.weight", first, False)
    assert not stage_keeps("model.embed_tokens.weight", last, False)
    assert stage_keeps("model.embed_tokens.weight", last, True)  # a tied head reads it
    assert stage_keeps("lm_head.weight", last, False) and not stage_keeps("lm_head.weight", first, False)
    assert stage_keeps("model.language_model.norm.weight", last, False)
    assert not stage_keeps("model.norm.weight", first, False)


def test_pp2_and_tp2_pp2_equal_one_process(three_layers):
    single, stats = _run(three_layers)
    assert stats.prefix_cache_hits > 0  # (the shared prefix was found in the cache)
    pp, _ = _run(three_layers, pipeline_parallel_size=2)
    _assert_same(single, pp)
    both, _ = _run(three_layers, pipeline_parallel_size=2, tensor_parallel_size=2)  # 4 processes
    _assert_same(single, both)


def test_pp_refuses_what_does_not_cross_stages(three_layers):
    with pytest.raises(ConfigError, match="more than the model's 3 decoder layers"):
        EngineArgs(model=three_layers, pipeline_parallel_size=4).create_engine_config()
    with pytest.raises(ConfigError, match=">= 1"):
        EngineArgs(model=three_layers, pipeline_parallel_size=0).create_engine_config()
    with pytest.raises(ConfigError, match="LoRA adapters .* pipeline parallelism"):
        EngineArgs(model=three_layers, pipeline_parallel_size=2, enable_lora=True).create_engine_config()
    config = EngineArgs(model=three_layers, pipeline_parallel_size=2).create_engine_config()
    assert config.pipeline_parallel_size == 2 and not config.async_scheduling


def test_dead_stage_worker_fails_generate_fast(three_layers):
    """The first stage (a worker) dies: the last stage's receive fails at once, not a hang."""
    llm = LLM(three_layers, pipeline_parallel_size=2, **OPTS)
    try:
        (pid,) = llm.core.tp_driver.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises((WorkerDiedError, RuntimeError)):
            llm.generate(_prompts(), SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - start < 15
    finally:
        llm.shutdown()


def test_dead_stage_worker_ends_requests_and_health(three_layers):
    """In the engine core process: the request ends with the cause, health fails, within seconds."""

    async def main() -> None:
        engine = AsyncEngine.from_engine_args(EngineArgs(model=three_layers, pipeline_parallel_size=2, **OPTS))
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0)
            async for _ in engine.generate(_prompts()[0], params, "before"):
                pass
            await engine.check_health()
            (pid,) = children(engine.client.proc.pid)  # the first stage's worker, the core's child
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError) as failed:
                async for _ in engine.generate(_prompts()[1], params, "after"):
                    pass
            assert str(failed.value)
            deadline = time.monotonic() + 15
            while True:
                try:
                    await engine.check_health()
                except EngineDeadError:
                    break
                assert time.monotonic() < deadline, "health still passes"
                await asyncio.sleep(0.2)
            assert time.monotonic() - start < 15
        finally:
            engine.shutdown()

    asyncio.run(main())
