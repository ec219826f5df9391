"""Data parallelism: two engine cores (processes) behind one AsyncEngine and one API server.

DP=2 must give one core's greedy tokens; requests go to both cores (by prefix affinity, then the
shorter queue); an abort reaches the core that owns the request; metrics are per core (`engine`
label, as vLLM's); health is every core healthy.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import httpx
import openai
import pytest
from server_utils import start_server

from llmserve import LLM, AsyncEngine, EngineArgs, SamplingParams
from llmserve.config import ConfigError
from llmserve.engine.dp_front import DPBalancer, combine_results, sum_stats
from llmserve.engine.ipc import UtilityResult
from llmserve.engine.request import SchedulerStats
from llmserve.errors import EngineDeadError
from llmserve.metrics import _EngineStateCollector

OPTS = dict(max_model_len=256, enable_prefix_caching=True)


def _prompts() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n)]} for n in (4, 23, 40, 71, 17, 33)]


def test_balancer_prefers_the_core_with_the_prefix_then_the_shorter_queue():
    b = DPBalancer(2, block_size=4, slack=0)
    shared = list(range(10, 30))  # five blocks
    assert b.pick(shared + [1]) == 0
    assert b.pick([7] * 9) == 1  # a new prefix: the least loaded core
    assert b.pick(shared + [2, 3]) == 0  # the prefix's core, as loaded as the other
    assert b.affinity_hits == 1
    assert b.pick(shared + [4]) == 1  # core 0 is now ahead of core 1 (slack 0): the shorter queue
    b.done(0), b.done(0)
    assert b.loads == [0, 2] and b.routed == [2, 2]
    assert b.pick([5, 6, 7]) == 0  # shorter than a block: no prefix, the least loaded


def test_stats_summed_and_utility_answers_combined():
    one = SchedulerStats(num_running=2, num_blocks_total=10, num_blocks_used=5, prefix_cache_hits=7,
                         spec_accepted_per_position=(1, 2))  # fmt: skip
    two = SchedulerStats(num_running=1, num_blocks_total=10, num_blocks_used=0, prefix_cache_hits=3,
                         spec_accepted_per_position=(3, 4))  # fmt: skip
    total = sum_stats([one, two])
    assert (total.num_running, total.prefix_cache_hits, total.kv_cache_usage) == (3, 10, 0.25)
    assert total.spec_accepted_per_position == (4, 6)
    assert combine_results([UtilityResult(1, True), UtilityResult(1, False)]).result is False
    assert combine_results([UtilityResult(1, {"a": 1}), UtilityResult(1, {"a": 1})]).result == {"a": 1}
    assert "core 1: boom" in combine_results([UtilityResult(1, None), UtilityResult(1, error="boom")]).error


def test_dp_refusals(llama_dir):
    with pytest.raises(ConfigError, match=">= 1"):
        EngineArgs(model=llama_dir, data_parallel_size=0).create_engine_config()
    with pytest.raises(ConfigError, match="AsyncEngine"):
        LLM(llama_dir, data_parallel_size=2)


@pytest.mark.integration
def test_dp2_equals_one_core_balances_aborts_and_reports_per_core(llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(llama_dir, **OPTS) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]

    async def main() -> None:
        engine = AsyncEngine.from_engine_args(EngineArgs(model=llama_dir, data_parallel_size=2, **OPTS))
        client = engine.client
        try:

            async def run(i: int, prompt: dict, p: SamplingParams = params) -> list[int]:
                async for out in engine.generate(prompt, p, f"r{i}"):
                    last = out
                return last.outputs[0].token_ids

            got = await asyncio.gather(*(run(i, p) for i, p in enumerate(_prompts())))
            assert got == want
            assert min(client.balancer.routed) > 0  # both cores got work, and computed it
            assert all(s.num_computed_tokens_total > 0 for s in engine.stats_by_rank())
            assert engine.stats().num_computed_tokens_total == sum(s.num_computed_tokens_total
                                                                   for s in engine.stats_by_rank())  # fmt: skip
            assert await engine.reset_prefix_cache() is True  # every core answered
            # a long request on each core; aborting one stops it on its own core only
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            fresh = {"a": [1, 5, 9], "b": [1, 6, 10]}  # no prefix seen: each to the least loaded core
            streams = {name: engine.generate({"prompt_token_ids": ids}, long, name) for name, ids in fresh.items()}
            for stream in streams.values():
                await stream.__anext__()
            rank = {name: client.rank_of(name) for name in streams}
            assert sorted(rank.values()) == [0, 1]
            await streams["b"].aclose()  # the client went away: the front aborts "b"
            deadline = time.monotonic() + 20
            while engine.stats_by_rank()[rank["b"]].num_running:
                assert time.monotonic() < deadline, "the abort did not reach b's core"
                await asyncio.sleep(0.05)
            assert engine.stats_by_rank()[rank["a"]].num_running == 1  # a still runs on the other
            await streams["a"].aclose()
            assert {s.labels["engine"] for f in _EngineStateCollector(engine, "m").collect() for s in f.samples
                    if s.name == "vllm:num_requests_running"} == {"0", "1"}  # fmt: skip
            await engine.check_health()
            os.kill(client.clients[1].proc.pid, signal.SIGKILL)  # one core dies: the front is unhealthy
            deadline = time.monotonic() + 15
            while not engine.errored:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            with pytest.raises(EngineDeadError, match="data-parallel engine core 1"):
                await engine.check_health()
        finally:
            engine.shutdown()

    asyncio.run(main())


@pytest.mark.integration
def test_serve_with_two_engine_cores_through_openai(llama_dir, tmp_path):
    srv = start_server(["--model", llama_dir, "--max-model-len", "128", "--data-parallel-size", "2"],
                       str(tmp_path / "log"), timeout=300)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        for i in range(4):
            reply = client.completions.create(model=model, prompt=f"hello {i}", max_tokens=4, temperature=0)
            assert reply.usage.completion_tokens == 4 or reply.choices[0].finish_reason == "stop"
        metrics = httpx.get(f"{srv.base_url}/metrics").text
        for engine in ("0", "1"):  # each core's series, both computed tokens
            assert re.search(rf'vllm:prefix_cache_queries_total\{{[^}}]*engine="{engine}"[^}}]*\}} [1-9]', metrics), (
                metrics
            )
        assert "data parallel: 2 engine cores" in srv.log()
    finally:
        srv.stop()
