"""The gateway in front of real `llmserve serve` replicas, called with the official openai client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx
import openai
import pytest
from gateway_utils import spawn_replica, start_gateway, start_redis
from server_utils import free_port, metric, wait_healthy

from llmserve.gateway.affinity import prefix_key, rendezvous_score
from llmserve.gateway.config import ApiKey, GatewayConfig, LimitsConfig, hash_key
from llmserve.gateway.limits import LimitExceeded, LimitsUnavailable, OverCapacity, build_limiter

pytestmark = pytest.mark.integration

KEYS = {
    "good": "sk-good",
    "revoked": "sk-revoked",
    "lite-only": "sk-lite-only",
    "limited": "sk-limited",
    "tokens": "sk-tokens",
}
LONG = {"max_tokens": 200, "extra_body": {"ignore_eos": True}}


def _config(tiny_urls: list[str], lite_url: str) -> dict:
    return {
        "models": {
            "tiny": {"replicas": tiny_urls, "model": "tiny-up", "fallback": "lite"},
            "lite": {"replicas": [lite_url], "model": "lite-up"},
            "capped": {"replicas": [lite_url], "model": "lite-up", "max_concurrency": 1, "fallback": "tiny"},
            "sticky": {
                "replicas": tiny_urls,
                "model": "tiny-up",
                "routing": "prefix_affinity",
                "affinity_prefix_chars": 64,
                "affinity_max_imbalance": 1,
            },
        },
        "keys": [
            {"name": "good", "sha256": hash_key(KEYS["good"])},
            {"name": "revoked", "sha256": hash_key(KEYS["revoked"]), "revoked": True},
            {"name": "lite-only", "sha256": hash_key(KEYS["lite-only"]), "models": ["lite"]},
            {"name": "limited", "sha256": hash_key(KEYS["limited"]), "rpm": 2},
            {"name": "tokens", "sha256": hash_key(KEYS["tokens"]), "tpm": 1000},
        ],
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2},
        "max_body_bytes": 4096,
        "body_timeout_s": 1.0,
    }


@pytest.fixture(scope="module")
def platform(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    ports = {name: free_port() for name in ("a", "b", "lite")}
    names = {"a": "tiny-up", "b": "tiny-up", "lite": "lite-up"}
    spawned = {n: spawn_replica(llama_dir, names[n], p, str(tmp / f"{n}.log")) for n, p in ports.items()}
    replicas = {n: wait_healthy(s) for n, s in spawned.items()}
    gateway = start_gateway(
        _config([replicas["a"].base_url, replicas["b"].base_url], replicas["lite"].base_url), free_port(), str(tmp)
    )
    env = {"replicas": replicas, "gateway": gateway, "llama_dir": llama_dir, "ports": ports, "tmp": tmp}
    yield env
    gateway.stop()
    for server in env["replicas"].values():
        server.stop()


def _client(platform, key: str = KEYS["good"]) -> openai.OpenAI:
    return openai.OpenAI(base_url=platform["gateway"].base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def _successes(server) -> float:
    return metric(server.base_url, "vllm:request_success_total")


def _gateway_metric(platform, name: str) -> float:
    return metric(platform["gateway"].base_url, name)


def _upstreams(platform) -> dict[str, bool]:
    return httpx.get(platform["gateway"].base_url + "/health").json()["upstreams"]


def _wait(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_config_is_checked():
    good = _config(["http://127.0.0.1:1"], "http://127.0.0.1:2")
    GatewayConfig.model_validate(good)
    bad_fallback = {**good, "models": {"tiny": {"replicas": ["http://x:1"], "fallback": "nope"}}}
    for bad in (bad_fallback, {**good, "keys": [{"name": "k", "sha256": "plain-text-key"}]}, {"models": {}}):
        with pytest.raises(ValueError):
            GatewayConfig.model_validate(bad)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = start_redis(free_port(), str(tmp_path_factory.mktemp("redis")))
    yield server.base_url
    server.stop()


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_rate_limiter_takes_both_buckets_or_neither_and_settles(backend, request):
    url = request.getfixturevalue("redis_url") if backend == "redis" else None
    config = LimitsConfig(backend=backend, url=url, prefix=f"test-{uuid.uuid4().hex}")

    async def run() -> None:
        limiter = build_limiter([ApiKey(name="k", sha256="0" * 64, rpm=3, tpm=100)], config)
        try:
            await limiter.reserve("k", 60)
            with pytest.raises(LimitExceeded) as info:
                await limiter.reserve("k", 60)
            assert info.value.reason == "tokens_per_minute" and info.value.retry_after >= 1
            await limiter.settle("k", reserved=60, used=10)  # 50 come back
            await limiter.reserve("k", 85)
            with pytest.raises(OverCapacity) as info:
                await limiter.reserve("k", 101)  # more than the bucket holds: never admissible
            assert info.value.retry_after is None and (info.value.asked, info.value.capacity) == (101, 100)
            await limiter.reserve("k", 1)  # the refused ones took no request: this is the 3rd
            with pytest.raises(LimitExceeded) as info:
                await limiter.reserve("k", 1)
            assert info.value.reason == "requests_per_minute" and 1 <= info.value.retry_after <= 20
        finally:
            await limiter.close()

    asyncio.run(run())


def test_redis_limits_refuse_when_redis_is_down_unless_fail_open():
    dead = f"redis://127.0.0.1:{free_port()}/0"
    keys = [ApiKey(name="k", sha256="0" * 64, rpm=3)]

    async def run(fail_open: bool) -> None:
        limiter = build_limiter(keys, LimitsConfig(backend="redis", url=dead, fail_open=fail_open))
        try:
            await limiter.reserve("k", 1)
        finally:
            await limiter.close()

    with pytest.raises(LimitsUnavailable):
        asyncio.run(run(False))
    asyncio.run(run(True))


def test_limits_held_exactly_across_two_gateways_sharing_redis(platform, redis_url):
    """Two gateway processes, one Redis: 20 concurrent requests spread over both, rpm 7."""
    lite = platform["replicas"]["lite"]
    config = {
        "models": {"lite": {"replicas": [lite.base_url], "model": "lite-up"}},
        "keys": [{"name": "shared", "sha256": hash_key("sk-shared"), "rpm": 7}],
        "limits": {"backend": "redis", "url": redis_url, "prefix": f"gw-{uuid.uuid4().hex}"},
    }
    gateways = [start_gateway(config, free_port(), str(platform["tmp"]), name=f"redis-gw{i}") for i in range(2)]
    try:
        before = _successes(lite)

        def call(i: int) -> httpx.Response:
            body = {"model": "lite", "prompt": "x", "max_tokens": 1}
            url = gateways[i % 2].base_url + "/v1/completions"
            return httpx.post(url, json=body, headers={"Authorization": "Bearer sk-shared"}, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            replies = list(pool.map(call, range(20)))
        ok = [r for r in replies if r.status_code == 200]
        refused = [r for r in replies if r.status_code == 429]
        assert len(ok) == 7 and len(refused) == 13, [r.status_code for r in replies]
        assert all(r.json()["error"]["code"] == "requests_per_minute" for r in refused)
        assert all(1 <= int(r.headers["Retry-After"]) <= 9 for r in refused)  # one request refills in 60/7 s
        assert _successes(lite) - before == 7  # the refused ones reached no upstream
    finally:
        for g in gateways:
            g.stop()


def test_chat_and_completions_plain_and_streamed(platform):
    client = _client(platform)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert chat.model == "tiny" and chat.choices[0].message.content is not None
    assert chat.usage.completion_tokens >= 1
    comp = client.completions.create(model="tiny", prompt="hello", max_tokens=8)
    assert comp.model == "tiny" and comp.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert len(chunks) >= 2 and all(c.model == "tiny" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    streamed = list(client.completions.create(
        model="tiny", prompt="hello", stream=True, stream_options={"include_usage": True}, **LONG
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    assert streamed[-1].usage.completion_tokens == 200 and streamed[-1].model == "tiny"
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=2, extra_headers={"x-request-id": "req-123"}
    )
    assert raw.headers["x-request-id"] == "req-123" and raw.headers["x-llmserve-served-by"] == "tiny"
    access = [json.loads(line.split("llmserve.gateway.access: ", 1)[1])
              for line in platform["gateway"].log().splitlines() if "llmserve.gateway.access: " in line]  # fmt: skip
    assert {"request_id": "req-123", "status": 200, "alias": "tiny", "served_by": "tiny"}.items() <= next(
        a for a in access if a["request_id"] == "req-123"
    ).items()


def test_models_lists_the_aliases_a_key_may_call(platform):
    assert sorted(m.id for m in _client(platform).models.list()) == ["capped", "lite", "sticky", "tiny"]
    assert [m.id for m in _client(platform, KEYS["lite-only"]).models.list()] == ["lite"]


@pytest.mark.parametrize("key", ["sk-wrong", KEYS["revoked"], None])
def test_missing_wrong_or_revoked_key_is_401(platform, key):
    before = sum(_successes(s) for s in platform["replicas"].values())
    if key is None:
        resp = httpx.post(platform["gateway"].base_url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "AuthenticationError"
    else:
        with pytest.raises(openai.AuthenticationError):
            _client(platform, key).completions.create(model="tiny", prompt="x", max_tokens=2)
    assert sum(_successes(s) for s in platform["replicas"].values()) == before


def test_disallowed_model_is_403_and_reaches_no_upstream(platform):
    before = {n: _successes(s) for n, s in platform["replicas"].items()}
    with pytest.raises(openai.PermissionDeniedError):
        _client(platform, KEYS["lite-only"]).completions.create(model="tiny", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        _client(platform).completions.create(model="../etc/passwd\u202e", prompt="x", max_tokens=2)
    assert {n: _successes(s) for n, s in platform["replicas"].items()} == before


def test_rate_limit_is_429_with_retry_after(platform):
    client = _client(platform, KEYS["limited"])
    for _ in range(2):
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert int(info.value.response.headers["Retry-After"]) >= 1
    assert info.value.body["code"] == "requests_per_minute"


def test_token_limit_reserves_up_front_and_settles_with_usage(platform):
    client = _client(platform, KEYS["tokens"])
    too_long = {"model": "tiny", "prompt": "word " * 300, "max_tokens": 250}  # reserves about 625 of 1000
    for _ in range(2):  # the upstream refuses it (over --max-model-len): the reservation comes back
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**too_long)
    for _ in range(2):  # each settles at its real usage, about 253
        assert client.completions.create(model="tiny", prompt="x", **LONG).usage.completion_tokens == 200
    # about 500 left, 975 asked: refused even if the bucket refilled for half a minute meanwhile
    # (1000 a minute; the two requests above can take seconds each on a loaded machine)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(**{**too_long, "max_tokens": 600})
    assert info.value.body["code"] == "tokens_per_minute"
    assert int(info.value.response.headers["Retry-After"]) >= 1


def test_invalid_json_is_400(platform):
    headers = {"Authorization": f"Bearer {KEYS['good']}", "content-type": "application/json"}
    resp = httpx.post(platform["gateway"].base_url + "/v1/completions", content=b"{nope", headers=headers)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"


def test_body_sent_too_slowly_is_408(platform):
    host, port = platform["gateway"].base_url.removeprefix("http://").split(":")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEYS['good']}\r\nContent-Length: 100\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head.encode() + b'{"model": "tiny", ')  # and the rest never comes
        started = time.monotonic()
        reply = b""
        while b"body_timeout" not in reply and (part := conn.recv(4096)):  # headers and body may come apart
            reply += part
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and "body_timeout" in reply
    assert time.monotonic() - started < 5


def test_oversized_body_is_413(platform):
    before = sum(_successes(s) for s in platform["replicas"].values())
    with pytest.raises(openai.APIStatusError) as info:
        _client(platform).completions.create(model="tiny", prompt="x" * 10_000, max_tokens=2)
    assert info.value.status_code == 413
    assert sum(_successes(s) for s in platform["replicas"].values()) == before


def test_prefix_key_is_the_shared_start_of_the_prompt():
    system = [{"role": "system", "content": "You are a pirate. " * 10}]
    one = prefix_key({"messages": [*system, {"role": "user", "content": "hi"}]}, 64)
    two = prefix_key({"messages": [*system, {"role": "user", "content": [{"type": "text", "text": "yo"}]}]}, 64)
    assert one == two == ("You are a pirate. " * 4)[:64]
    assert prefix_key({"messages": [{"role": "user", "content": "abc"}]}, 64) == "user:abc"
    assert prefix_key({"prompt": ["first prompt", "second"]}, 5) == "first"
    assert prefix_key({"prompt": [1, 2, 3]}, 64) == "[1, 2, 3]"


def test_prefix_affinity_sends_a_shared_prefix_to_one_replica(platform):
    a, b = platform["replicas"]["a"], platform["replicas"]["b"]
    # system prompts chosen so that both replicas are the home of some (rendezvous hashing)
    homes: dict[str, str] = {}
    for i in range(50):
        text = f"System prompt number {i}: answer briefly and politely, in plain words."
        key = prefix_key({"messages": [{"role": "system", "content": text}]}, 64)
        homes[text] = max((a.base_url, b.base_url), key=lambda url: rendezvous_score(key, url))
        if len(homes) >= 4 and len(set(homes.values())) == 2:
            break
    client = _client(platform)
    for text, home in homes.items():
        before = {s.base_url: _successes(s) for s in (a, b)}
        for user in ("alice", "bob", "carol"):
            messages = [{"role": "system", "content": text}, {"role": "user", "content": f"I am {user}"}]
            client.chat.completions.create(model="sticky", messages=messages, max_tokens=2)
        got = {url: _successes(s) - before[url] for url, s in ((a.base_url, a), (b.base_url, b))}
        assert got[home] == 3 and sum(got.values()) == 3, (text, got)
    # one prefix, more concurrent work than its home may hold over the other: the rest overflow
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: client.completions.create(model="sticky", prompt="same start", **LONG), range(6)))
    counts = {
        line.split('decision="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in httpx.get(platform["gateway"].base_url + "/metrics").text.splitlines()
        if line.startswith('llmserve_gateway_routing_total{alias="sticky"')
    }
    assert counts["affinity"] >= len(homes) * 3 + 2 and counts["affinity_overloaded"] >= 1, counts


def test_least_outstanding_spreads_load_over_both_replicas(platform):
    a, b = platform["replicas"]["a"], platform["replicas"]["b"]
    before = (_successes(a), _successes(b))
    client = _client(platform)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda _: client.completions.create(model="tiny", prompt="s", max_tokens=32), range(8)))
    assert all(r.usage.completion_tokens >= 1 for r in done)
    got = (_successes(a) - before[0], _successes(b) - before[1])
    assert sum(got) == 8 and min(got) >= 3, got


def test_fallback_when_the_primary_is_over_its_concurrency_cap(platform):
    client = _client(platform)

    def served_by(_) -> tuple[str, str]:
        raw = client.completions.with_raw_response.create(model="capped", prompt="busy", **LONG)
        return raw.headers["x-llmserve-served-by"], raw.parse().model

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        served = list(pool.map(served_by, range(6)))
    assert set(served) == {("capped", "capped"), ("tiny", "tiny")}  # "capped" holds one at a time
    assert served_by(0) == ("capped", "capped")  # idle again: back to the primary


def test_client_disconnect_mid_stream_frees_upstream_kv_blocks(platform):
    replicas = [platform["replicas"]["a"], platform["replicas"]["b"]]
    before = sum(_successes(s) for s in replicas)
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEYS['good']}"}
    with httpx.stream("POST", platform["gateway"].base_url + "/v1/completions", json=body, headers=headers) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        assert sum(metric(s.base_url, "vllm:num_kv_blocks_used") for s in replicas) > 0
    assert _wait(lambda: all(metric(s.base_url, "vllm:num_kv_blocks_used") == 0 for s in replicas))
    assert sum(_successes(s) for s in replicas) == before  # aborted, not run to the end
    assert _gateway_metric(platform, "llmserve_gateway_upstream_outstanding") == 0


def test_killed_replica_fails_no_request_that_had_not_started_streaming(platform):
    b = platform["replicas"]["b"]
    client = _client(platform)

    def call(i: int) -> int:
        return client.completions.create(model="tiny", prompt=f"kill {i}", **LONG).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(call, i) for i in range(12)]
        assert _wait(lambda: metric(b.base_url, "vllm:num_requests_running") > 0)
        b.proc.kill()  # mid-run, with requests in flight on it
        b.proc.wait()
        results = [f.result() for f in futures]
    assert results == [LONG["max_tokens"]] * 12  # every one ran to the end
    assert _gateway_metric(platform, "llmserve_gateway_retries_total") >= 1
    assert _wait(lambda: not _upstreams(platform)[b.base_url])  # the breaker opened


def test_fallback_while_primary_is_down_and_back_after(platform):
    a = platform["replicas"]["a"]
    a.stop()  # b was killed by the test before: every replica of "tiny" is down now
    client = _client(platform)
    raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=4)
    assert raw.headers["x-llmserve-served-by"] == "lite" and raw.parse().model == "lite"
    streamed = list(client.completions.create(model="tiny", prompt="x", max_tokens=4, stream=True))
    assert all(c.model == "lite" for c in streamed)

    log = str(platform["tmp"] / "a2.log")
    back = wait_healthy(spawn_replica(platform["llama_dir"], "tiny-up", platform["ports"]["a"], log))
    platform["replicas"]["a"] = back
    assert _wait(lambda: _upstreams(platform)[back.base_url])
    raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=4)
    assert raw.headers["x-llmserve-served-by"] == "tiny" and raw.parse().model == "tiny"


def test_gateway_metrics(platform):
    text = httpx.get(platform["gateway"].base_url + "/metrics").text
    assert 'llmserve_gateway_requests_total{alias="tiny",status="200"}' in text
    assert 'llmserve_gateway_rejections_total{reason="invalid_api_key"} 3.0' in text
    assert 'llmserve_gateway_rejections_total{reason="model_not_allowed"} 1.0' in text
    assert 'llmserve_gateway_rejections_total{reason="requests_per_minute"} 1.0' in text
    assert 'llmserve_gateway_rejections_total{reason="body_too_large"} 1.0' in text
    assert "llmserve_gateway_request_latency_seconds_bucket" in text
    assert 'llmserve_gateway_fallbacks_total{alias="tiny",served_by="lite"} 2.0' in text
    b_url = platform["replicas"]["b"].base_url
    assert f'llmserve_gateway_upstream_healthy{{alias="tiny",replica="{b_url}"}} 0.0' in text


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank"])
def test_embeddings_and_rerank_refuse_hostile_input_before_any_upstream(platform, path):
    url = platform["gateway"].base_url + path
    body = {"model": "tiny", "input": "x", "query": "q", "documents": ["d"]}
    before = _gateway_metric(platform, "llmserve_gateway_requests_total")

    def post(key: str | None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(url, headers=headers, **(kwargs or {"json": body}))

    cases = [
        (post(None), 401, "invalid_api_key"),
        (post("sk-wrong"), 401, "invalid_api_key"),
        (post(KEYS["revoked"]), 401, "invalid_api_key"),
        (post(KEYS["lite-only"]), 403, "model_not_allowed"),
        (post(KEYS["good"], json={**body, "model": "tiny\x00;rm -rf"}), 404, "model_not_found"),
        (post(KEYS["good"], json={**body, "input": "x" * 10_000}), 413, "body_too_large"),
        (post(KEYS["good"], content=b"[1, 2"), 400, "invalid_json"),
    ]  # fmt: skip
    for resp, status, code in cases:
        assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), resp.text
    assert _gateway_metric(platform, "llmserve_gateway_requests_total") == before  # none went upstream


def test_gateway_starts_without_torch():
    """The front door is a plain HTTP proxy: importing it (and its CLI) must not pull in
    torch and the engine (seconds of start-up and hundreds of MB per gateway process)."""
    code = (
        "import sys; import llmserve.gateway.app; from llmserve.cli import build_parser; "
        "build_parser('gateway'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _BreakingUpstream:
    """An OpenAI-compatible stream that breaks after two events: the connection closes with
    no [DONE] (`cut="eof"`) or in the middle of a chunked body (`cut="chunk"`). /health is 200."""

    def __init__(self, cut: str):
        self.cut = cut
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(65536)
                if head.startswith(b"GET"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    continue
                event = (
                    b'data: {"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":"a"}]}\n\n'
                )
                if self.cut == "eof":
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                                 + event * 2)  # fmt: skip
                else:
                    chunk = b"%x\r\n%s\r\n" % (len(event), event)
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n" + chunk * 2 + b"ff\r\ndata: {")  # fmt: skip

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("cut", ["eof", "chunk"])
def test_a_stream_that_breaks_upstream_ends_with_an_error_event(cut, tmp_path):
    """After the first byte nothing can be retried: the client gets what came, then an error
    event and [DONE] (it saw the stream just stop before), and the request counts as a 502."""
    upstream = _BreakingUpstream(cut)
    gateway = start_gateway({"models": {"m": {"replicas": [f"http://127.0.0.1:{upstream.port}"]}}},
                            free_port(), str(tmp_path))  # fmt: skip
    try:
        body = {"model": "m", "prompt": "x", "stream": True}
        with httpx.stream("POST", gateway.base_url + "/v1/completions", json=body, timeout=30) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        # (aiohttp may drop what it buffered of a chunked body that breaks: one "a" or two)
        assert 3 <= len(events) <= 4 and all(json.loads(e[6:])["choices"][0]["text"] == "a" for e in events[:-2])
        assert json.loads(events[-2][6:])["error"]["code"] == "bad_gateway" and events[-1] == "data: [DONE]", events
        assert _wait(lambda: '"status": 502' in gateway.log())
    finally:
        gateway.stop()
        upstream.close()


def test_triton_errors_are_told_apart():
    """A Triton error the request caused (the embed and rerank models' gRPC statuses) is a
    400; one the model or server caused is retried elsewhere and, where none answers, a 5xx.
    (The chat model answers its refusals as OpenAI errors with their status instead.)"""
    from tritonclient.utils import InferenceServerException

    from llmserve.gateway.triton_upstream import _client_fault, _message

    client = [InferenceServerException("bad", status="StatusCode.INVALID_ARGUMENT"),
              InferenceServerException("decoupled", status="StatusCode.UNIMPLEMENTED")]  # fmt: skip
    server = [InferenceServerException("Stub process 'chat_0_0' is not healthy."),
              InferenceServerException("boom", status="StatusCode.INTERNAL")]  # fmt: skip
    assert all(_client_fault(e) for e in client) and not any(_client_fault(e) for e in server)
    traced = InferenceServerException("UnicodeDecodeError: bad byte\n\nAt:\n  /tmp/x/embed/1/model.py(17): execute\n")
    assert _message(traced) == "UnicodeDecodeError: bad byte"  # no server paths to the client


def test_a_request_waits_for_a_replica_that_comes_back_and_fails_fast_without_the_wait(llama_dir, tmp_path):
    """Its only replica down (a restart): the request is held and retried with backoff until the
    replica is back, within `retry_unstarted_s`; with 0 it fails at once, as before."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = {"models": {"solo": {"replicas": [url], "model": "solo-up"}},
            "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2}}  # fmt: skip
    waiting = start_gateway({**base, "retry_unstarted_s": 90}, free_port(), str(tmp_path), "waiting")
    failing = start_gateway({**base, "retry_unstarted_s": 0}, free_port(), str(tmp_path), "failing")
    replica = None
    try:
        start = time.monotonic()
        resp = httpx.post(failing.base_url + "/v1/completions", json={"model": "solo", "prompt": "x", "max_tokens": 2})
        assert resp.status_code in (502, 503) and time.monotonic() - start < 5, resp.text
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"model": "solo", "prompt": "x", "max_tokens": 3, "ignore_eos": True}
            held = pool.submit(httpx.post, waiting.base_url + "/v1/completions", json=body, timeout=120)
            time.sleep(1.5)
            assert not held.done()  # held, not failed
            replica = wait_healthy(spawn_replica(llama_dir, "solo-up", port, str(tmp_path / "solo.log")))
            resp = held.result()
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3, resp.text
    finally:
        for server in (waiting, failing, replica):
            if server is not None:
                server.stop()


@pytest.mark.parametrize("fail_open", [False, True])
def test_redis_stopped_and_started_under_a_running_gateway(platform, tmp_path, fail_open):
    """Redis stopped under a gateway process: its key's requests are refused with 503
    `limits_unavailable` (fail closed, the default) or let through (fail_open), never a 500; Redis
    started again (empty: nothing persisted): the limits are exact again at once, 5 of 8 within rpm 5."""
    port = free_port()
    redis = start_redis(port, str(tmp_path))
    lite = platform["replicas"]["lite"]
    config = {
        "models": {"lite": {"replicas": [lite.base_url], "model": "lite-up"}},
        "keys": [{"name": "r", "sha256": hash_key("sk-redis"), "rpm": 5}],
        "limits": {"backend": "redis", "url": redis.base_url, "prefix": f"gw-{uuid.uuid4().hex}", "fail_open": fail_open,
                   "timeout_s": 0.5},
    }  # fmt: skip
    gateway = start_gateway(config, free_port(), str(tmp_path), name=f"redis-outage-{fail_open}")

    def call(_: int = 0) -> httpx.Response:
        body = {"model": "lite", "prompt": "x", "max_tokens": 1}
        return httpx.post(gateway.base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-redis"},
                          timeout=60)  # fmt: skip

    try:
        assert [call().status_code for _ in range(2)] == [200, 200]
        redis.stop()
        during = [call() for _ in range(3)]
        if fail_open:
            assert [r.status_code for r in during] == [200] * 3, [r.text for r in during]
        else:
            assert all(r.status_code == 503 and r.json()["error"]["code"] == "limits_unavailable" for r in during)
            assert all(r.headers["Retry-After"] == "1" for r in during)
        redis = start_redis(port, str(tmp_path))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(call, range(8)))
        codes = sorted(r.status_code for r in replies)
        assert codes == [200] * 5 + [429] * 3, [r.text for r in replies]
    finally:
        gateway.stop()
        redis.stop()


def test_metrics_and_dashboard_exposure_is_configurable(platform, tmp_path):
    """`expose:` metrics keyed (a valid key, as Prometheus sends it), the dashboard off (404);
    `keyed` on an open gateway is refused at start."""
    lite = platform["replicas"]["lite"]
    config = {"models": {"lite": {"replicas": [lite.base_url], "model": "lite-up"}},
              "keys": [{"name": "ops", "sha256": hash_key("sk-ops")}, {"name": "old", "sha256": hash_key("sk-old"),
                                                                        "revoked": True}],
              "expose": {"metrics": "keyed", "dashboard": "off"}}  # fmt: skip
    gateway = start_gateway(config, free_port(), str(tmp_path), name="exposure")
    try:
        url = gateway.base_url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer sk-old"}):
            resp = httpx.get(url + "/metrics", headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        resp = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-ops"})
        assert resp.status_code == 200 and "llmserve_gateway_requests_total" in resp.text
        for path in ("/dashboard", "/dashboard/data"):
            assert httpx.get(url + path, headers={"Authorization": "Bearer sk-ops"}).status_code == 404
        assert httpx.get(url + "/health").status_code == 200  # for load balancers: always open
    finally:
        gateway.stop()
    with pytest.raises(ValueError, match="keyed"):
        GatewayConfig.model_validate({"models": {"m": {"replicas": ["http://x:1"]}}, "expose": {"metrics": "keyed"}})


def test_the_gateway_refuses_a_request_head_over_its_limit_with_431(platform):
    from server_utils import big_header_request, raw_http

    gateway = platform["gateway"].base_url
    assert raw_http(gateway, big_header_request("/health", 8_000)).startswith(b"HTTP/1.1 200")
    answer = raw_http(gateway, big_header_request("/v1/models", 70_000))
    assert answer.startswith(b"HTTP/1.1 431") and b"headers_too_large" in answer, answer[:200]
    assert httpx.get(gateway + "/health").status_code == 200


def test_a_busy_replica_is_shed_at_once_and_a_request_that_breaks_its_replica_is_sent_twice_at_most(tmp_path):
    """retry_unstarted_s waits only for replicas that are down: one at its max_concurrency is
    busy, and the request is refused at once (503); a request the replica took and then failed
    on (it dropped the connection: the request may be what breaks it) is sent again once, not
    for the whole wait. Two misbehaving stub replicas: a slow one and one that drops."""
    from server_utils import StubHandler, stub_server

    posts = []

    class Stub(StubHandler):
        def do_GET(self):  # healthy to the health checks
            self.reply(b"{}")

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            if self.server.slow:  # answers after 3 s
                time.sleep(3)
                self.reply(b'{"choices": [{"text": "x"}], "usage": {"total_tokens": 2}}')
                return
            posts.append(self.path)  # takes the request, then drops the connection without an answer
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    with stub_server(Stub, slow=True) as slow, stub_server(Stub, slow=False) as dropper:
        config = {"models": {"solo": {"replicas": [f"http://127.0.0.1:{slow.server_port}"], "max_concurrency": 1},
                             "breaker": {"replicas": [f"http://127.0.0.1:{dropper.server_port}"]}},
                  "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 5}, "retry_unstarted_s": 60}  # fmt: skip
        gateway = start_gateway(config, free_port(), str(tmp_path), name="busy")
        body = {"model": "solo", "prompt": "x", "max_tokens": 2}
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                first = pool.submit(httpx.post, gateway.base_url + "/v1/completions", json=body, timeout=30)
                time.sleep(1.0)  # it holds the only slot of `solo` for 3 s
                start = time.monotonic()
                busy = httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=60)
                assert busy.status_code == 503 and time.monotonic() - start < 1.5, busy.text
                assert first.result().status_code == 200
            start = time.monotonic()
            broken = httpx.post(
                gateway.base_url + "/v1/completions", json={"model": "breaker", "prompt": "x"}, timeout=90
            )
            assert broken.status_code in (502, 503) and time.monotonic() - start < 10, broken.text
            assert len(posts) == 2, posts  # the first try and one more
        finally:
            gateway.stop()


def test_a_triton_streams_event_leaves_whole_before_the_next_one_exists():
    """Each event of a Triton chat stream goes out with the blank line that ends it, in one
    write: an SSE client (the openai SDK) takes a token as soon as it comes. (The blank line
    once went out with the next event, so such clients saw each token one token late.)"""
    from llmserve.gateway.config import ModelRoute
    from llmserve.gateway.context import RequestContext
    from llmserve.gateway.proxy import _rewrite_model
    from llmserve.gateway.router import Pick, Replica
    from llmserve.gateway.triton_upstream import Backend, TritonClients, _generate, chat_events

    def chunk(text: str) -> str:
        return 'data: {"id":"x","model":"chat","choices":[{"index":0,"delta":{"content":"' + text + '"}}]}'

    async def main() -> list[str]:
        gate = asyncio.Event()

        async def responses():
            yield 200, chunk("one")
            await gate.wait()  # the next token does not exist yet
            yield 200, chunk("two") + "\n\n" + chunk("three")  # two events in one response
            yield 200, "data: [DONE]"

        clients = TritonClients()
        clients.events = lambda *args, **kw: chat_events(responses(), 5.0, Backend())
        ctx = RequestContext("r", "/v1/chat/completions", "chat", {"stream": True}, True, None)
        pick = Pick(
            "chat", ModelRoute(kind="triton", replicas=["http://127.0.0.1:1"]), Replica("chat", "http://127.0.0.1:1")
        )
        opened = await _generate(clients, ctx, pick, "chat")
        writes = [_rewrite_model(opened.first, "chat", ctx) + "\n"]  # what the gateway's relay writes
        assert not gate.is_set()
        gate.set()
        writes += [_rewrite_model(line, "chat", ctx) + "\n" async for line in opened.lines]
        await opened.close()
        return writes

    writes = asyncio.run(main())
    assert writes == [chunk("one") + "\n\n", chunk("two") + "\n\n", chunk("three") + "\n\n", "data: [DONE]\n\n"]
    # a chunk that names another model (an upstream's own name) is rewritten; its newlines are kept
    ctx = RequestContext("r", "/v1/chat/completions", "alias", {"stream": True}, True, None)
    assert _rewrite_model(chunk("x") + "\n", "alias", ctx) == chunk("x").replace('"chat"', '"alias"') + "\n"
    usage = 'data: {"model":"alias","choices":[],"usage":{"total_tokens":7}}\n'
    assert _rewrite_model(usage, "alias", ctx) == usage and ctx.used_tokens == 7


def test_triton_over_http_reads_big_events_and_tells_failures_apart():
    """The HTTP transport against a real HTTP server speaking Triton's generate_stream: an event
    of 1 MB (a whole answer: past aiohttp's 512 KiB line limit) arrives whole; an error status
    is the gRPC status Triton gives for it; an error event mid-stream is raised; a port nobody
    listens on is a refused call (retried elsewhere, never accepted)."""
    from aiohttp import web
    from tritonclient.utils import InferenceServerException

    from llmserve.gateway.triton_http import CallBroken, TritonHttp
    from llmserve.gateway.triton_upstream import _client_fault

    big = "x" * (1 << 20)

    async def generate_stream(request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        if model == "missing":
            return web.json_response({"error": "Request for unknown model: 'missing' is not found"}, status=404)
        if model == "refuses":
            return web.json_response({"error": "expected 1 input"}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        body = await request.json()
        await resp.write(
            b"data: " + json.dumps({"model_name": model, "status": [200], "response": big}).encode() + b"\n\n"
        )
        if model == "fails":
            await resp.write(b'data: {"error": "Stub process is not healthy."}\n\n')
        await resp.write(b"data: " + json.dumps({"status": 200, "response": body["endpoint"]}).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v2/models/{model}/generate_stream", generate_stream)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        http = TritonHttp(timeout=10)
        url = f"http://127.0.0.1:{port}"
        try:
            got = [r async for r in http.responses(url, "chat", {"request": "{}", "endpoint": "/v1/completions"})]
            assert got == [(200, big), (200, "/v1/completions")]
            with pytest.raises(InferenceServerException) as missing:
                await anext(http.responses(url, "missing", {}))
            assert "unknown model" in str(missing.value) and "NOT_FOUND" in str(missing.value.status())
            with pytest.raises(InferenceServerException) as refused:
                await anext(http.responses(url, "refuses", {}))
            assert _client_fault(refused.value)
            stream = http.responses(url, "fails", {"endpoint": "/v1/completions"})
            assert (await anext(stream))[1] == big
            with pytest.raises(InferenceServerException, match="not healthy"):
                await anext(stream)
            with pytest.raises(CallBroken) as broken:
                await anext(http.responses(f"http://127.0.0.1:{free_port()}", "chat", {}))
            assert broken.value.refused
        finally:
            await http.close()
            await runner.cleanup()

    asyncio.run(main())
