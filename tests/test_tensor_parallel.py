"""Tensor parallelism on CPU: two real processes with gloo collectives.

TP=2 must give the same greedy tokens as TP=1 (and the same log-probabilities within
float32 rounding: the sums of the row-parallel layers are split in two); a worker that
dies must make the engine fail fast — an error, never a hang.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import children, start_server

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.engine.tp_workers import WorkerDiedError
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.integration


def _prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n)]} for n in (4, 23, 40, 71)]


def _run(model: str, tp: int, **kwargs):
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, prompt_logprobs=2)  # (every rank's LM head)
    with LLM(model, tensor_parallel_size=tp, **kwargs) as llm:
        outs = llm.generate(_prompts(7), params, use_tqdm=False)
        assert llm.stats().num_blocks_used == 0
    return outs


def _assert_same(single, split) -> None:
    for a, b in zip(single, split):
        sa, sb = a.outputs[0], b.outputs[0]
        assert sa.token_ids == sb.token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for la, lb in zip([*sa.logprobs, *a.prompt_logprobs[1:]], [*sb.logprobs, *b.prompt_logprobs[1:]]):
            assert la.keys() == lb.keys()
            for token in la:
                assert la[token].logprob == pytest.approx(lb[token].logprob, abs=2e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_tp2_equals_tp1(model_dirs, family):
    """llama: untied LM head, llama3 rope; qwen2: tied embeddings, qkv bias; gemma3: its window,
    norms and scaled embedding over a vocabulary split in two."""
    _assert_same(_run(model_dirs[family], 1), _run(model_dirs[family], 2))


def test_moe_tp2_and_ep2_equal_tp1(tmp_path):
    """A mixture of experts (Qwen2-MoE: a shared expert, and a dense layer between sparse ones) split
    two ways: TP=2 (every expert's intermediate slice per rank) and EP=2 (--enable-expert-parallel:
    4 whole experts per rank, every token routed on both) give TP=1's greedy tokens and logprobs."""
    model = str(make_random_model(tmp_path / "moe", "qwen2_moe", seed=3, num_hidden_layers=3, mlp_only_layers=[1]))
    opts = dict(max_model_len=128, max_num_batched_tokens=32)  # chunked prompts beside decodes
    single = _run(model, 1, **opts)
    _assert_same(single, _run(model, 2, **opts))
    _assert_same(single, _run(model, 2, enable_expert_parallel=True, **opts))


def test_tp2_odd_vocab_chunked_prefill_and_preemption(tmp_path):
    """A vocabulary that does not split evenly (the last rank's rows are padded), with
    chunked prefill and preemption by swapping KV blocks out and back on every rank."""
    model = str(make_random_model(tmp_path / "m", "mistral", seed=5, vocab_size=517))
    opts = dict(
        block_size=8,
        num_gpu_blocks_override=16,
        max_model_len=128,
        swap_space=0.001,
        max_num_batched_tokens=24,
        admission_reserve_tokens=0,
    )  # admissions that fill the blocks, so that requests preempt
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


def test_server_with_dead_worker_reports_unhealthy_and_core_exits(llama_dir, tmp_path):
    srv = start_server(["--model", llama_dir, "--max-model-len", "128", "--tensor-parallel-size", "2"],
                       str(tmp_path / "log"))  # fmt: skip
    try:
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=30).status_code == 200
        worker = int(re.search(r"tensor parallel: 2 ranks \(workers \[(\d+)\]\)", srv.log()).group(1))
        assert worker in children(srv.proc.pid, recursive=True)
        assert re.search(r"tensor-parallel rank 1: \d+ start-up objects kept out", srv.log())
        core = int(Path(f"/proc/{worker}/status").read_text().split("PPid:")[1].split()[0])
        procs = [core, *children(core, recursive=True)]
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


def test_biases_on_every_projection_match_transformers_and_split(tmp_path):
    """Llama with attention_bias (q/k/v and o_proj) and mlp_bias: TP=1 equals transformers,
    TP=2 equals TP=1 (row-parallel biases are added once, after the all-reduce)."""
    from conftest import hf_greedy

    model = str(make_random_model(tmp_path / "m", "llama", seed=9, attention_bias=True, mlp_bias=True))
    single = _run(model, 1)
    prompts = [p["prompt_token_ids"] for p in _prompts(7)]
    assert [r.outputs[0].token_ids for r in single] == hf_greedy(model, prompts, 16)
    _assert_same(single, _run(model, 2))


def _edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("tp", [1, 2])
def test_checkpoint_shapes_are_checked_whole_on_every_rank(tmp_path, tp):
    """A checkpoint whose k/v projections hold fewer heads than the config says, or fewer
    vocabulary rows, is refused — also when a rank's share happens to match it."""
    heads = make_random_model(tmp_path / "heads", "llama", seed=1)
    _edit_config(heads, num_key_value_heads=4)  # the weights hold 2
    with pytest.raises(ValueError, match="k_proj.weight: checkpoint shape"):
        LLM(str(heads), tensor_parallel_size=tp)
    vocab = make_random_model(tmp_path / "vocab", "llama", seed=1)
    _edit_config(vocab, vocab_size=600)  # the weights hold 512 rows
    with pytest.raises(ValueError, match=r"(embed_tokens|lm_head).weight: checkpoint shape \(512, 64\) != \(600, 64\)"):
        LLM(str(vocab), tensor_parallel_size=tp)


def _spawned_children() -> set[int]:
    return {c for c in children(os.getpid()) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()}


def test_worker_dying_during_start_up_fails_the_engine_without_hanging(llama_dir):
    before = _spawned_children()
    errors: list[BaseException] = []

    def build() -> None:
        try:
            LLM(llama_dir, tensor_parallel_size=2).shutdown()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    deadline = time.monotonic() + 20
    while not (_spawned_children() - before):
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    os.kill(next(iter(_spawned_children() - before)), signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive(), "the engine hung after its worker died"
    assert errors and isinstance(errors[0], WorkerDiedError), errors


SCRIPT = """
import asyncio, json, sys
from llmserve import LLM, AsyncEngine, EngineArgs, SamplingParams
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
with LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=128) as llm:
    tp2 = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], params, use_tqdm=False)[0].outputs[0].token_ids

async def stream():
    engine = AsyncEngine.from_engine_args(EngineArgs(model=sys.argv[1], max_model_len=128))
    try:
        async for out in engine.generate({"prompt_token_ids": [1, 5, 9, 13]}, params, "r1"):
            last = out
        return last.outputs[0].token_ids
    finally:
        engine.shutdown()

print("TOKENS", json.dumps([tp2, asyncio.run(stream())]))
"""


@pytest.mark.parametrize("how", ["stdin", "unguarded file"])
def test_a_script_without_a_main_guard_or_file_starts_engine_processes(llama_dir, tmp_path, how):
    """A script piped to `python -` (multiprocessing's spawn looked for a file '<stdin>', and
    the worker died) or a file without `if __name__ == "__main__":` (spawn ran it again in
    every child): the engine core and tensor-parallel workers start from llmserve's own code."""
    import subprocess
    import sys

    with LLM(llama_dir, max_model_len=128) as llm:
        want = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=8, temperature=0.0,
                            ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    if how == "stdin":
        cmd, stdin = [sys.executable, "-", llama_dir], SCRIPT
    else:
        (tmp_path / "script.py").write_text(SCRIPT)
        cmd, stdin = [sys.executable, str(tmp_path / "script.py"), llama_dir], None
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS ") :]) == [want, want]
    assert proc.stdout.count("TOKENS") == 1  # the script ran once, not again in each child


def test_tp2_in_fp8_quantizes_each_ranks_slice(llama_dir):
    """FP8 under tensor parallelism: each rank quantizes its own slice (row-parallel layers
    get their own row scales per rank), so TP=2 stays close to TP=1 without being equal."""
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = _prompts(11)
    with LLM(llama_dir, quantization="fp8", max_model_len=128) as one:
        single = one.generate(prompts, params, use_tqdm=False)
    with LLM(llama_dir, quantization="fp8", tensor_parallel_size=2, max_model_len=128) as two:
        split = two.generate(prompts, params, use_tqdm=False)
    for a, b in zip(single, split):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        for token in first_a.keys() & first_b.keys():
            assert first_a[token].logprob == pytest.approx(first_b[token].logprob, abs=0.05)


def test_tp2_sleeps_and_wakes_on_every_rank(llama_dir):
    """Sleep and wake are mirrored to the workers: each rank frees and gets back its shard."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, tensor_parallel_size=2, max_model_len=128) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(_prompts(3), params, use_tqdm=False)]
        for level in (1, 2):
            llm.sleep(level)
            assert llm.is_sleeping()
            assert [o.outputs[0].token_ids for o in llm.generate(_prompts(3), params, use_tqdm=False)] == before
