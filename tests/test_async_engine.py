"""AsyncEngine with the engine core in its own process, over ZeroMQ."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from conftest import hf_greedy

from llmserve import AsyncEngine, EngineArgs, SamplingParams
from llmserve.engine.core_client import EngineDeadError, EngineStartError
from llmserve.engine.input_processor import PromptTooLongError

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = AsyncEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=512))
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, params, started: asyncio.Event | None = None, **kw):
    outs = []
    async for out in engine.generate(prompt, params, **kw):
        outs.append(out)
        if started is not None:
            started.set()
    return outs


LONG = SamplingParams(max_tokens=400, ignore_eos=True)


async def _wait_idle(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_streaming_matches_transformers(engine, llama_dir):
    prompt = [1, 30, 31, 32, 33]
    outs = asyncio.run(_collect(engine, {"prompt_token_ids": prompt}, GREEDY))
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 10
    want = hf_greedy(llama_dir, [prompt], 10)[0]
    assert final.outputs[0].token_ids[: len(want)] == want


def test_concurrent_requests_all_finish(engine):
    async def main():
        prompts = [{"prompt_token_ids": [1, 5 + i, 6, 7]} for i in range(16)]
        results = await asyncio.gather(*[_collect(engine, p, GREEDY) for p in prompts])
        await _wait_idle(engine)
        return results

    results = asyncio.run(main())
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 10 for r in results)


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        agen = engine.generate({"prompt_token_ids": list(range(1, 60))}, LONG)
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await agen.aclose()
        await _wait_idle(engine)
        # a cancelled task aborts too
        started = asyncio.Event()
        task = asyncio.create_task(_collect(engine, {"prompt_token_ids": [1, 2, 3]}, LONG, started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _wait_idle(engine)

    stats = asyncio.run(main())
    assert stats.num_blocks_used == 0


def test_explicit_abort(engine):
    async def main():
        started = asyncio.Event()
        task = asyncio.create_task(_collect(engine, "abort me", LONG, started, request_id="to-abort"))
        await started.wait()
        await engine.abort("to-abort")
        with pytest.raises(RuntimeError, match="aborted"):
            await task
        return await _wait_idle(engine)

    asyncio.run(main())


def test_bad_input_rejected_others_keep_running(engine):
    async def main():
        good = asyncio.create_task(_collect(engine, {"prompt_token_ids": [1, 2, 3]}, GREEDY))
        with pytest.raises(PromptTooLongError):
            await _collect(engine, {"prompt_token_ids": [5] * 600}, GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(
                _collect(engine, "x", GREEDY, request_id="same"),
                _collect(engine, "y", GREEDY, request_id="same"),
            )
        return await good

    outs = asyncio.run(main())
    assert outs[-1].finished


def test_stop_string_aborts_in_core(engine):
    async def main():
        free = await _collect(engine, {"prompt_token_ids": [1, 20, 21]}, GREEDY)
        text = free[-1].outputs[0].text
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, stop=text[3:5])
        outs = await _collect(engine, {"prompt_token_ids": [1, 20, 21]}, params)
        await _wait_idle(engine)
        return text, outs[-1].outputs[0]

    text, out = asyncio.run(main())
    assert out.finish_reason == "stop" and out.text == text[: text.index(text[3:5])]


def test_dead_core_is_reported_not_hung(llama_dir):
    engine = AsyncEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=512))

    async def main():
        started = asyncio.Event()
        task = asyncio.create_task(_collect(engine, "x", LONG, started))
        await started.wait()
        os.kill(engine.client.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, timeout=10)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(engine, "y", GREEDY)

    try:
        asyncio.run(main())
    finally:
        start = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - start < 5


def test_start_failure_carries_reason(llama_dir):
    args = EngineArgs(model=llama_dir, max_model_len=256, num_gpu_blocks_override=2)
    with pytest.raises(EngineStartError, match="KV cache holds"):
        AsyncEngine.from_engine_args(args)


def test_concurrent_utility_calls_each_get_their_answer(engine):
    """Utility calls carry their own ids: two at once both return (a second call of the same
    utility used to replace the first one's waiter, which then waited 30 s and failed)."""

    async def main():
        started = time.monotonic()
        results = await asyncio.gather(*(engine.reset_prefix_cache() for _ in range(4)))
        return results, time.monotonic() - started

    results, took = asyncio.run(main())
    assert results == [True] * 4 and took < 10


def test_messages_between_front_and_core_are_typed():
    import pickle

    from llmserve.engine.ipc import Kind, Message, UtilityCall, UtilityResult

    for msg in (
        Message(Kind.UTILITY, UtilityCall(3, "reset_prefix_cache")),
        Message(Kind.UTILITY_RESULT, UtilityResult(3, True)),
    ):
        again = pickle.loads(pickle.dumps(msg))
        assert again.kind is msg.kind and again.payload == msg.payload
