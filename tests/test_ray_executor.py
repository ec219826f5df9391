"""The Ray executor (--distributed-executor-backend ray) on a local Ray cluster of two nodes.

Ray's cluster utilities start two real nodes (a GCS, two raylets) on this machine, one CPU each,
every address on 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray on the loopback). TP=2
then has to place its two ranks on different nodes; it must give the single process's greedy
tokens, and a worker actor killed through Ray must fail the engine within seconds. A cluster too
small for the placement group fails the start fast, saying what is missing.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from llmserve import LLM, AsyncEngine, EngineArgs, SamplingParams
from llmserve.config import ConfigError, executor_config
from llmserve.engine.executor import RankSpec, placement_from_gpus
from llmserve.errors import EngineDeadError

pytestmark = pytest.mark.integration

OPTS = dict(max_model_len=128, enable_prefix_caching=True)
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    saved = {
        k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED")
    }
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # (read when Ray is imported)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # nothing sent anywhere
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = c.address  # what the engine joins (its core process inherits it)
        ray.init()
        yield ray
    finally:
        ray.shutdown()
        c.shutdown()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def _prompts() -> list[dict]:
    rng = random.Random(5)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n)]} for n in (4, 23, 40)]


def test_executor_settings_are_checked(llama_dir, monkeypatch):
    with pytest.raises(ConfigError, match="must be mp or ray"):
        EngineArgs(model=llama_dir, distributed_executor_backend="slurm").create_engine_config()
    with pytest.raises(ConfigError, match="ray_placement_strategy must be one of"):
        executor_config("ray", "TIGHT", 10, 1)
    with pytest.raises(ConfigError, match="data parallelism with the Ray executor"):
        executor_config("ray", "PACK", 10, 2)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match="needs Ray, which is not installed: pip install"):
        executor_config("ray", "STRICT_PACK", 10, 1)
    assert executor_config("mp", "STRICT_PACK", 10, 2).backend == "mp"  # mp never asks for Ray


def test_gpu_placement_per_node():
    """Ranks on two nodes: each actor sees its node's GPUs of this engine and picks its own; the
    driver (rank 0, the GPU its holder actor was given) keeps its own view of the GPUs."""
    gpus = {0: ("A", ["3"]), 1: ("A", ["1"]), 2: ("B", ["0"]), 3: ("B", ["5"])}
    placed = placement_from_gpus("10.0.0.1", 4, gpus, None)
    assert placed.visible_devices == (None, "1,3", "0,5", "0,5")
    assert placed.device_index == (3, 0, 0, 1)
    assert placed.spec(2, 29500) == RankSpec(2, "10.0.0.1:29500", 0, "0,5")
    assert placement_from_gpus("10.0.0.1", 4, gpus, "2,3").device_index[0] == 1  # GPU 3 is its second


def test_tp2_over_two_nodes_equals_one_process_and_a_killed_actor_fails_the_engine(cluster, llama_dir):
    ray = cluster
    with LLM(llama_dir, **OPTS) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]

    async def main() -> None:
        args = EngineArgs(model=llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray",
                          ray_placement_strategy="SPREAD", **OPTS)  # fmt: skip
        engine = AsyncEngine.from_engine_args(args)
        try:
            got = []
            for i, prompt in enumerate(_prompts()):
                outs = [out async for out in engine.generate(prompt, PARAMS, f"r{i}")]
                got.append(outs[-1].outputs[0].token_ids)
            assert got == want
            # rank 0 (the engine core) and rank 1 (an actor) sit on the two nodes
            (group,) = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
            assert len(set(group["bundles_to_node_id"].values())) == 2
            (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("llmserve-")]
            assert actor["name"].endswith("-rank1")
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            start = time.monotonic()
            with pytest.raises(EngineDeadError) as failed:
                async for _ in engine.generate(_prompts()[0], PARAMS, "after"):
                    pass
            assert str(failed.value)
            while True:
                try:
                    await engine.check_health()
                except EngineDeadError:
                    break
                assert time.monotonic() - start < 15, "health still passes"
                await asyncio.sleep(0.2)
        finally:
            engine.shutdown()

    asyncio.run(main())
    deadline = time.monotonic() + 20  # the dead engine's group and actors are given back to the cluster
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)


def test_a_cluster_too_small_fails_fast_saying_what_is_missing(cluster, llama_dir):
    """Two 1-CPU nodes cannot hold two 1-CPU ranks on one node (STRICT_PACK)."""
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        LLM(
            llama_dir,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            ray_placement_timeout=3,
            ray_placement_strategy="STRICT_PACK",
            **OPTS,
        )
    assert time.monotonic() - start < 30
    message = str(refused.value)
    assert "could not place 2 ranks within 3 s" in message and "2 x 1 CPUs" in message
    assert "STRICT_PACK" in message and "PACK or SPREAD spans nodes" in message
    assert "2 node(s)" in message and "2 CPUs (2 free)" in message
    states = [g["state"] for g in cluster.util.placement_group_table().values()]
    assert "CREATED" not in states and "PENDING" not in states  # the group was given back
