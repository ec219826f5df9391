"""Sleep mode: an idle engine gives its device memory back and gets it again, with the same
outputs; a request arriving while it sleeps waits for the wake; the server's routes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys

import httpx
import pytest
from server_utils import free_port, spawn, start_server, wait_healthy

from llmserve import LLM, AsyncEngine, EngineArgs, SamplingParams

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i]} for i in range(3)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_greedy_outputs(model_dirs, level):
    """Level 1 keeps the weights in host memory; level 2 reads them again (FP8 re-quantized
    the same way): the outputs after waking are the outputs before sleeping."""
    for family, extra in (("llama", {}), ("qwen2", {"quantization": "fp8"})):
        llm = LLM(model_dirs[family], max_model_len=128, **extra)
        before = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        llm.sleep(level)
        assert llm.is_sleeping() and sum(p.numel() for p in llm.core.runner.model.parameters()) == 0
        assert llm.core.runner.kv_caches == []
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before  # the request woke it
        assert not llm.is_sleeping() and llm.stats().num_blocks_used == 0


def test_weight_stash_round_trip_against_the_tensors():
    """The packed host buffer gives back every tensor bit for bit: mixed dtypes (FP8, a
    scalar, an empty one), odd sizes; a second stash reuses the buffer when it fits."""
    import torch

    from llmserve.engine.weight_stash import ALIGN, WeightStash

    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(7, 13, dtype=torch.bfloat16), "fp8": torch.randn(5, 3).to(torch.float8_e4m3fn),
        "scale": torch.tensor(0.25), "empty": torch.empty(0, 4), "ids": torch.arange(11),
        "strided": torch.randn(6, 4).t(),
    }  # fmt: skip
    stash = WeightStash()
    stash.stash(tensors, pin=False)
    host = stash.host
    assert all(s.offset % ALIGN == 0 for s in stash.slots)
    back = stash.restore(torch.device("cpu"))
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else back[name],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor)  # fmt: skip
    stash.stash({"w": tensors["w"]}, pin=False)
    assert stash.host is host  # smaller: the same buffer again
    assert torch.equal(stash.restore(torch.device("cpu"))["w"], tensors["w"])


def test_tied_embeddings_and_rotary_tables_survive_sleep(tmp_path):
    """A model with a tied LM head wakes with its outputs; the rotary table, which
    no checkpoint holds, comes back at level 2 too."""
    import torch

    from llmserve.model.random_model import make_random_model

    path = make_random_model(str(tmp_path / "tied"), tie_word_embeddings=True)
    llm = LLM(path, max_model_len=128)
    model = llm.core.runner.model
    before = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    tables = {n: b.clone() for n, b in model.named_buffers()}
    for level in (2, 1):
        llm.sleep(level)
        assert tables and all(b.numel() == 0 for _, b in model.named_buffers())
        llm.wake_up()
        assert all(torch.equal(b, tables[n]) for n, b in model.named_buffers())
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before


def test_requests_during_sleep_wait_for_the_wake_and_complete(llama_dir):
    async def main():
        engine = AsyncEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=128))
        try:

            async def run(prompt, params=GREEDY, started=None):
                final = None
                async for out in engine.generate(prompt, params):
                    final = out
                    if started is not None:
                        started.set()
                return final.outputs[0].token_ids

            before = [await run(p) for p in PROMPTS]
            started = asyncio.Event()
            long = SamplingParams(max_tokens=120, ignore_eos=True)
            busy = asyncio.create_task(run({"prompt_token_ids": [1, 2, 3]}, long, started))
            await started.wait()
            assert await engine.sleep(1) is False  # a request in flight: not now
            await busy
            assert await engine.sleep(2) and await engine.is_sleeping()
            after = await asyncio.gather(*(run(p) for p in PROMPTS))  # all arrive asleep, one wake
            assert list(after) == before and not await engine.is_sleeping()
            assert engine.stats().num_blocks_used == 0
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_server_sleep_routes(llama_dir, tmp_path):
    """The sleep-mode routes, behind the admin key (the API itself stays open here); and the
    server's body size limit (413 in OpenAI's shape, declared or streamed)."""
    port = free_port()  # a server without the flag, started now and looked at last (two cores: side by side)
    plain = spawn([sys.executable, "-m", "llmserve", "serve", llama_dir, "--max-model-len", "128", "--port", str(port)],
                  port, str(tmp_path / "plain.log"))  # fmt: skip
    try:
        _sleep_routes(llama_dir, tmp_path)
        wait_healthy(plain)  # without the flag the routes are not there
        assert httpx.post(plain.base_url + "/sleep").status_code == 404
    finally:
        plain.stop()


def _sleep_routes(llama_dir, tmp_path) -> None:
    srv = start_server([llama_dir, "--max-model-len", "128", "--enable-sleep-mode", "--served-model-name", "tiny",
                        "--max-request-body-bytes", "4096"], str(tmp_path / "server.log"),
                       env={"LLMSERVE_ADMIN_API_KEY": "adm1n"})  # fmt: skip
    url = srv.base_url
    admin = {"Authorization": "Bearer adm1n"}
    try:
        body = {"model": "tiny", "prompt": [1, 5, 9, 33], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        want = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "adm1n"}):
            refused = httpx.post(url + "/sleep", params={"level": 1}, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert "adm1n" not in open(tmp_path / "server.log").read()  # never logged
        assert httpx.post(url + "/sleep", params={"level": 3}, headers=admin).status_code == 400
        assert httpx.post(url + "/sleep", params={"level": 1}, headers=admin).json() == {
            "is_sleeping": True,
            "level": 1,
        }
        assert httpx.get(url + "/is_sleeping", headers=admin).json() == {"is_sleeping": True}
        assert httpx.get(url + "/health").status_code == 200  # asleep is healthy: requests wake it
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # requests during sleep wait, then all succeed
            replies = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(4)))
        assert all(r.status_code == 200 and r.json()["choices"][0]["text"] == want for r in replies)
        assert httpx.get(url + "/is_sleeping", headers=admin).json() == {"is_sleeping": False}
        assert httpx.post(url + "/sleep", params={"level": 2}, headers=admin).status_code == 200
        assert httpx.post(url + "/wake_up", headers=admin).json() == {"is_sleeping": False}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
        big = {**body, "prompt": [1] * 3000}  # about 6 KB of JSON
        declared = httpx.post(url + "/v1/completions", json=big, timeout=30)
        streamed = httpx.post(url + "/v1/completions", content=iter([b'{"prompt": [', b"1, " * 3000, b"1]}"]),
                              headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        for refused in (declared, streamed):
            assert refused.status_code == 413 and refused.json()["error"]["type"] == "RequestTooLarge"
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200  # still serving
    finally:
        srv.stop()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_mode_arenas_keep_every_address_and_the_outputs(model_dirs, tmp_path, level):
    """With enable_sleep_mode the weights and KV cache live in arenas (on a GPU at fixed
    virtual addresses, so the CUDA graphs stay): every tensor keeps its address across a
    sleep, the memory under them is given back (the CPU reference scrambles it), and the
    wake puts back exactly what the outputs need (FP8 scales and a tied head included)."""
    from llmserve.model.random_model import make_random_model

    tied = make_random_model(str(tmp_path / "tied"), tie_word_embeddings=True)
    for path, extra in ((model_dirs["llama"], {}), (model_dirs["qwen2"], {"quantization": "fp8"}), (tied, {})):
        llm = LLM(path, max_model_len=128, enable_sleep_mode=True, **extra)
        runner = llm.core.runner
        before = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        addresses = {n: t.data_ptr() for n, t in runner.sleep_mode.tensors().items()}
        kv = [c.data_ptr() for c in runner.kv_caches]
        arena = runner.sleep_mode.weights_arena.tensor
        assert all(arena.data_ptr() <= a < arena.data_ptr() + arena.numel() for a in addresses.values())
        llm.sleep(level)
        assert llm.core.memory_footprint()["device_bytes"] == 0
        assert bool((arena == 0xFF).all())  # the reference arena's memory went (scrambled)
        for _ in range(2):  # twice: the second sleep reuses the host buffer
            assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before  # woken by the request
            assert {n: t.data_ptr() for n, t in runner.sleep_mode.tensors().items()} == addresses
            assert [c.data_ptr() for c in runner.kv_caches] == kv and llm.stats().num_blocks_used == 0
            llm.sleep(level)
        llm.wake_up()
        assert not llm.is_sleeping()
