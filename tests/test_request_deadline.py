"""Request deadlines (llmserve/openai/deadline.py) on a real `llmserve serve`: a request's own
`request_timeout_s` and the server's `--request-timeout-s` cap; past it the generation stops in
the engine and the client gets a 504 (`request_timeout`), or a stream's last error event."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_utils import metric, start_server

from llmserve.model.random_model import make_random_model
from llmserve.openai.deadline import effective_timeout, with_deadline
from llmserve.openai.reply import Reply

pytestmark = pytest.mark.integration

CAP_S = 2.0
LONG = {"model": "tiny", "prompt": "a long story", "max_tokens": 3500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("deadline")
    model = make_random_model(
        root / "model", "llama", max_position_embeddings=4096, num_hidden_layers=4
    )  # long answers, slow enough
    srv = start_server(["--model", str(model), "--max-model-len", "4096", "--served-model-name", "tiny",
                        "--request-timeout-s", str(CAP_S)], str(root / "server.log"))  # fmt: skip
    yield srv
    srv.stop()


def _idle(server, timeout: float = 5.0) -> None:
    """The engine has nothing running or waiting (the stopped requests were aborted)."""
    deadline = time.monotonic() + timeout
    while metric(server.base_url, "vllm:num_requests_running") + metric(server.base_url, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the timed-out request still runs in the engine"
        time.sleep(0.05)


def test_effective_timeout_is_the_shorter_of_the_request_and_the_server():
    assert effective_timeout(None, None) is None
    assert effective_timeout(5.0, None) == 5.0
    assert effective_timeout(None, 7.0) == 7.0
    assert effective_timeout(5.0, 7.0) == 5.0 and effective_timeout(9.0, 7.0) == 7.0


def test_a_reply_without_a_deadline_is_left_as_it_is():
    reply = Reply(error={"error": {}}, status=400)
    assert with_deadline(reply, 1.0) is reply
    plain = Reply(body=None)
    assert with_deadline(plain, None) is plain


def test_a_stream_cut_by_its_deadline_closes_its_source():
    """The events past the deadline are never asked for, and the source is closed (its engine
    requests aborted)."""
    closed = []

    async def source():
        try:
            for i in range(1000):
                await asyncio.sleep(0.01)
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def run():
        return [e async for e in with_deadline(Reply(events=source()), 0.1).events]

    events = asyncio.run(run())
    assert closed == [True]
    assert 3 <= len(events) - 2 < 20, events
    assert json.loads(events[-2][len("data: ") :])["error"]["code"] == "request_timeout"
    assert events[-1] == "data: [DONE]\n\n"


def test_a_whole_answer_past_its_deadline_is_a_504_and_the_engine_stops(server):
    start = time.monotonic()
    resp = httpx.post(server.base_url + "/v1/completions", json={**LONG, "request_timeout_s": 1}, timeout=30)
    elapsed = time.monotonic() - start
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "request_timeout" and "within 1 s" in resp.json()["error"]["message"]
    assert 1 <= elapsed < 1 + 0.7, elapsed
    _idle(server)


def test_the_server_cap_holds_when_the_request_asks_for_more_or_nothing(server):
    for extra in ({}, {"request_timeout_s": 100}):
        start = time.monotonic()
        resp = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
            **{k: v for k, v in LONG.items() if k != "prompt"}, **extra,
            "messages": [{"role": "user", "content": "tell me a story"}]})  # fmt: skip
        assert resp.status_code == 504, resp.text
        assert CAP_S - 0.05 < time.monotonic() - start < CAP_S + 1.0
        assert f"{CAP_S:g} s" in resp.json()["error"]["message"]
    _idle(server)


def test_a_stream_past_its_deadline_ends_with_the_error_event_and_done(server):
    start = time.monotonic()
    events = []
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=30,
                      json={**LONG, "stream": True, "request_timeout_s": 1}) as resp:  # fmt: skip
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert 1 <= time.monotonic() - start < 1 + 0.7
    assert sum(1 for e in events if '"choices"' in e) >= 1  # tokens came before the deadline
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "request_timeout", events[-3:]
    assert events[-1] == "data: [DONE]"
    _idle(server)


def test_a_request_within_its_deadline_is_not_touched(server):
    resp = httpx.post(server.base_url + "/v1/completions", timeout=30,
                      json={**LONG, "max_tokens": 4, "request_timeout_s": 30})  # fmt: skip
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("value", [0, 0.5, 5e-324, -1, "soon", None, [1]])
def test_a_bad_request_timeout_is_a_400(server, value):
    resp = httpx.post(server.base_url + "/v1/completions", json={**LONG, "max_tokens": 2, "request_timeout_s": value})
    if value is None:  # null: no deadline of its own (the server's cap)
        assert resp.status_code == 200, resp.text
    else:
        assert resp.status_code == 400 and "request_timeout_s" in resp.text, resp.text
