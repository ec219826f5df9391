"""Tensor parallelism on CPU: two real processes with gloo collectives.

TP=2 must give the same greedy tokens as TP=1 (and the same log-probabilities within
float32 rounding: the sums of the row-parallel layers are split in two); a worker that
dies must make the engine fail fast — an error, never a hang.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.engine.tp_workers import WorkerDiedError
from llmserve.model.random_model import make_random_model
from server_utils import start_server


def _prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n)]} for n in (4, 23, 40, 71)]


def _run(model: str, tp: int, **kwargs):
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    with LLM(model, tensor_parallel_size=tp, **kwargs) as llm:
        outs = llm.generate(_prompts(7), params, use_tqdm=False)
        assert llm.stats().num_blocks_used == 0
    return outs


def _assert_same(single, split) -> None:
    for a, b in zip(single, split):
        sa, sb = a.outputs[0], b.outputs[0]
        assert sa.token_ids == sb.token_ids
        for la, lb in zip(sa.logprobs, sb.logprobs):
            assert la.keys() == lb.keys()
            for token in la:
                assert la[token].logprob == pytest.approx(lb[token].logprob, abs=2e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_equals_tp1(model_dirs, family):
    """llama: untied LM head, llama3 rope; qwen2: tied embeddings, qkv bias."""
    _assert_same(_run(model_dirs[family], 1), _run(model_dirs[family], 2))


def test_tp2_odd_vocab_chunked_prefill_and_preemption(tmp_path):
    """A vocabulary that does not split evenly (the last rank's rows are padded), with
    chunked prefill and preemption by swapping KV blocks out and back on every rank."""
    model = str(make_random_model(tmp_path / "m", "mistral", seed=5, vocab_size=517))
    opts = dict(block_size=8, num_gpu_blocks_override=16, max_model_len=128, swap_space=0.001, max_num_batched_tokens=24)
    _assert_same(_run(model, 1, **opts), _run(model, 2, **opts))


def test_tp_sizes_that_cannot_split_are_refused(llama_dir):
    with pytest.raises(ConfigError, match="not divisible by tensor_parallel_size 3"):
        EngineArgs(model=llama_dir, tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ConfigError, match=">= 1"):
        EngineArgs(model=llama_dir, tensor_parallel_size=0).create_engine_config()


def test_dead_worker_fails_generate_without_hanging(llama_dir):
    llm = LLM(llama_dir, tensor_parallel_size=2)
    try:
        (pid,) = llm.core.tp_driver.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises((WorkerDiedError, RuntimeError)):
            llm.generate(_prompts(1), SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < 20


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


def test_server_with_dead_worker_reports_unhealthy_and_core_exits(llama_dir, tmp_path):
    srv = start_server(["--model", llama_dir, "--max-model-len", "128", "--tensor-parallel-size", "2"],
                       str(tmp_path / "log"))  # fmt: skip
    try:
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=30).status_code == 200
        worker = int(re.search(r"tensor parallel: 2 ranks \(workers \[(\d+)\]\)", srv.log()).group(1))
        assert worker in _descendants(srv.proc.pid)
        core = int(Path(f"/proc/{worker}/status").read_text().split("PPid:")[1].split()[0])
        procs = [core, *_descendants(core)]
        os.kill(worker, signal.SIGKILL)
        # the next step meets the dead rank: the request fails, the engine is reported dead
        resp = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code in (500, 503) and resp.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.base_url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        while any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in procs):
            assert time.monotonic() < deadline, "engine core or worker still running"
            time.sleep(0.2)
    finally:
        srv.stop()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"
