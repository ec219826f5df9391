"""Server lifecycle: 503 until the engine is ready and after it dies; SIGTERM drains."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
import uvicorn
from server_utils import children, free_port, start_server

from llmserve import AsyncEngine, EngineArgs
from llmserve.serve.app import build_app
from llmserve.serve.state import ServerConfig

pytestmark = pytest.mark.integration


def test_health_503_until_engine_ready(llama_dir):
    release = threading.Event()

    def slow_engine():
        release.wait(30)
        return AsyncEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=128))

    port = free_port()
    app = build_app(ServerConfig(["m"], llama_dir), slow_engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                resp = httpx.get(f"{base}/health")
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert resp.status_code == 503
        not_ready = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert not_ready.status_code == 503 and "loading" in not_ready.json()["error"]["message"]
        release.set()
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def test_a_killed_engine_core_fails_its_requests_and_stops_the_server(llama_dir, tmp_path):
    """SIGKILL of the engine core under load: /health turns 503 at once, a stream in flight
    ends with an error event (no hang), new requests get 503 with the reason, and the server
    exits with status 1 after a short grace, for its supervisor to restart it."""
    srv = start_server(["--model", llama_dir, "--max-model-len", "512"], str(tmp_path / "log"))
    events: list[str] = []
    body = {"prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=30) as resp:
            events.extend(line for line in resp.iter_lines() if line)

    try:
        reader = threading.Thread(target=stream)
        reader.start()
        while not events:  # the stream has begun
            time.sleep(0.02)
        killed = time.monotonic()
        for child in children(srv.proc.pid):
            os.kill(child, signal.SIGKILL)
        while httpx.get(f"{srv.base_url}/health").status_code != 503:
            assert time.monotonic() - killed < 5
            time.sleep(0.05)
        resp = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
        reader.join(10)
        assert not reader.is_alive() and events[-1] == "data: [DONE]"
        assert '"error"' in events[-2] and "engine core process was killed by signal 9" in events[-2]
        assert json.loads(events[-2][len("data: ") :])["error"]["code"] == "engine_dead"
        assert srv.proc.wait(timeout=20) == 1
        assert "the engine core died" in srv.log()
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_and_exits(llama_dir, tmp_path):
    srv = start_server(
        ["--model", llama_dir, "--max-model-len", "512", "--shutdown-timeout", "20"], str(tmp_path / "log")
    )
    # 40 tokens take well under a second here, and a few seconds on a loaded 2-core machine (about
    # 11 a second seen): the stream must be drained to its end, not cut
    body = {"prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                if len(events) == 2:  # once: a second SIGTERM is uvicorn's forced exit
                    srv.proc.send_signal(signal.SIGTERM)
                    start = time.monotonic()
    drained = time.monotonic()
    srv.proc.wait(30)
    elapsed = time.monotonic() - drained
    assert elapsed < 10, f"took {elapsed:.1f} s to exit after its last request ended"
    assert drained - start < 20
    assert srv.proc.returncode in (0, -15)
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2].replace(" ", "")  # all 40 tokens made
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{srv.base_url}/health", timeout=1)


def test_admission_limit_gives_503_overloaded():
    """The admission rule behind --max-queued-requests (the HTTP path of a 503 is covered by
    the not-ready test above)."""
    from types import SimpleNamespace

    from llmserve.openai.errors import APIError
    from llmserve.serve.state import ServerState

    engine = SimpleNamespace(errored=False, num_unfinished=0)
    state = ServerState(ServerConfig(["m"], "/m", max_queued_requests=2), engine=engine)
    assert state.require_engine() is engine
    engine.num_unfinished = 2
    with pytest.raises(APIError) as exc:
        state.require_engine()
    assert exc.value.status == 503 and exc.value.code == "overloaded"
    engine.num_unfinished = 1
    assert state.require_engine() is engine


@pytest.mark.parametrize("kind", ["generate", "embed"])
def test_a_model_that_cannot_load_is_a_503_saying_why(llama_dir, kind):
    """Both servers load their model in the background (serve/common.py): when it fails,
    /health and the endpoints answer 503 with the reason, on_fatal hears it, /version and
    /metrics still answer, and the server shuts down cleanly."""
    from llmserve.serve.pooling_app import build_pooling_app

    def broken():
        raise RuntimeError("no weights here")

    fatal = []
    config = ServerConfig(["m"], llama_dir)
    builder = build_app if kind == "generate" else build_pooling_app
    app = builder(config, broken, on_fatal=fatal.append)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not fatal:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "failed to start: no weights here" in fatal[0]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "no weights here" in health.json()["error"]["message"]
        path, body = ("/v1/completions", {"prompt": "x"}) if kind == "generate" else ("/v1/embeddings", {"input": "x"})
        resp = httpx.post(base + path, json=body)
        assert resp.status_code == 503 and "no weights here" in resp.json()["error"]["message"]
        assert httpx.get(f"{base}/version").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["m"] and models[0]["max_model_len"] is None
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


def test_an_unwritable_request_timing_log_stops_the_server_at_once(llama_dir, tmp_path):
    """`--request-timing-log` into a folder that does not exist: exit status 1 with the
    flag and the reason, before any model loads."""
    import subprocess
    import sys

    bad = tmp_path / "no-such-folder" / "timing.jsonl"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llmserve", "serve", "--model", llama_dir, "--port", str(free_port()),
                           "--request-timing-log", str(bad)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1
    assert "--request-timing-log" in proc.stderr and "No such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - start < 30
