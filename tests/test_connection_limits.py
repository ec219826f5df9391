"""Held connections (issue 49, item 3) against real servers over raw sockets: `llmserve serve`
(generate and embed), `llmserve gateway` and `llmserve up`'s gateway. A request head or body that
stops coming gets 408; idle connections are closed; over the connection caps the connection
waiting longest for its client is shed so a new one gets in, and only when all are busy is the
new one refused (429 for its client's cap, 503 for the total). Short limits, set by the settings."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from gateway_utils import start_gateway
from server_utils import free_port, start_server

pytestmark = pytest.mark.integration

TINY = str(Path(__file__).resolve().parents[1] / "llmserve" / "assets" / "tiny_model")
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 2.0, 1.0
HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


def serve_limits(total: int, per_client: int) -> list[str]:
    return ["--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
            "--max-connections", str(total), "--max-connections-per-client", str(per_client)]  # fmt: skip


def gateway_limits(total: int, per_client: int) -> dict:
    return {"header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S, "max_connections": total,
            "max_connections_per_client": per_client}  # fmt: skip


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = start_server(["--model", TINY, "--max-model-len", "256", "--served-model-name", "tiny",
                        *serve_limits(30, 6)], str(log))  # fmt: skip
    yield srv.base_url
    srv.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway whose one replica is down: a completion waits for it (`retry_unstarted_s`), so
    its connection is busy for as long as the test wants."""
    down = f"http://127.0.0.1:{free_port()}"
    config = {"models": {"m": {"replicas": [down]}}, "retry_unstarted_s": 60, **gateway_limits(8, 3)}
    gw = start_gateway(config, free_port(), str(tmp_path_factory.mktemp("gateway")))
    yield gw.base_url
    gw.stop()


def connect(url: str, source: str = "127.0.0.1", timeout: float = 10.0) -> socket.socket:
    address = urlparse(url)
    conn = socket.socket()
    conn.bind((source, 0))
    conn.settimeout(timeout)
    conn.connect((address.hostname, address.port))
    return conn


def answer_of(conn: socket.socket) -> bytes:
    """All the server sends until it closes (b"" for a close without an answer)."""
    chunks = []
    try:
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, TimeoutError):  # a timeout: still held (the caller checks the time)
        pass
    conn.close()
    return b"".join(chunks)


def error_code(answer: bytes) -> str:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"]


def still_open(conn: socket.socket) -> bool:
    """Whether the server still holds `conn` (nothing to read and no close)."""
    conn.setblocking(False)
    try:
        conn.recv(1, socket.MSG_PEEK)  # an answer (before a close), or b"": closed
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        conn.setblocking(True)


def timed(work) -> tuple[bytes, float]:
    start = time.monotonic()
    result = work()
    return result, time.monotonic() - start


def check_head_timeouts(url: str) -> None:
    """A head that stops (or trickles) gets 408 after the header timeout; a silent connection is
    closed without an answer. Before: all three were held for as long as the client liked."""
    conn = connect(url)
    conn.sendall(HALF_HEAD)
    answer, waited = timed(lambda: answer_of(conn))
    assert answer.startswith(b"HTTP/1.1 408") and error_code(answer) == "header_timeout", answer[:200]
    assert HEADER_TIMEOUT_S - 0.2 < waited < HEADER_TIMEOUT_S + 3, waited
    conn = connect(url)
    answer, waited = timed(lambda: answer_of(conn))
    assert answer == b"" and waited < HEADER_TIMEOUT_S + 3
    conn = connect(url, timeout=0.25)  # one byte of a header every 0.25 s: the deadline is the whole head's
    conn.sendall(HALF_HEAD + b"X-Slow: ")
    start, answer = time.monotonic(), b""
    while time.monotonic() - start < HEADER_TIMEOUT_S + 3:
        try:
            conn.sendall(b"a")
            answer += conn.recv(65536)
            break
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    conn.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def check_body_timeout(url: str, path: str = "/v1/completions") -> None:
    """A body declared 1,000 bytes long that stops after 13: 408 after the body timeout, in
    OpenAI's error shape (before: no answer after 45 s on `llmserve serve`)."""
    conn = connect(url)
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 1000\r\n\r\n{\"model\": \"x\"".encode())  # fmt: skip
    answer, waited = timed(lambda: answer_of(conn))
    assert answer.startswith(b"HTTP/1.1 408") and error_code(answer) == "body_timeout", answer[:200]
    assert waited < BODY_TIMEOUT_S + 3, waited


def check_idle_connections_are_shed_for_new_ones(url: str, total: int, per_client: int, request) -> None:
    """`total` connections that sent half a head, from several addresses (none over its own cap):
    a normal request still gets in at once (the longest waiting one is shed for it), and the
    server holds no more than `total`. Then one address over its cap: its oldest connection goes.
    Before: the request waited behind them (or, at the open-file limit, failed)."""
    per_source = max(1, per_client - 1)
    held = []
    for i in range(total):
        held.append(connect(url, f"127.0.0.{10 + i // per_source}"))
        held[-1].sendall(HALF_HEAD)
    answer, waited = timed(request)
    assert answer == 200 and waited < HEADER_TIMEOUT_S - 0.5, (answer, waited)  # not the header timeout's doing
    assert not still_open(held[0]) and sum(map(still_open, held)) < total
    mine = [connect(url, "127.0.0.3") for _ in range(per_client)]
    for conn in mine:
        conn.sendall(HALF_HEAD)
    time.sleep(0.2)  # their half heads read
    newest = connect(url, "127.0.0.3")  # one over its address's cap: that address's oldest is shed
    newest.sendall(HALF_HEAD)
    shed = answer_of(mine[0])
    assert shed.startswith(b"HTTP/1.1 503") and error_code(shed) == "connection_shed", shed[:200]
    assert all(map(still_open, mine[1:] + [newest]))
    for conn in held + mine + [newest]:
        conn.close()


def test_serve_answers_408_to_a_head_that_never_ends_and_closes_idle_connections(serve):
    check_head_timeouts(serve)
    # a connection kept alive after a whole request: its next head has the same deadline
    conn = connect(serve)
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + HALF_HEAD)
    answer = answer_of(conn)
    assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in answer, answer[:300]
    # answered before its body ended (an unknown path): the rest of the body is read, then the
    # connection waits for a next head as any other, and is let go (not held as if busy)
    conn = connect(serve)
    conn.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
    time.sleep(0.3)
    conn.sendall(b"67890")
    answer, waited = timed(lambda: answer_of(conn))
    assert answer.startswith(b"HTTP/1.1 404") and answer.count(b"HTTP/1.1") == 1, answer[:300]
    assert waited < HEADER_TIMEOUT_S + 3, waited


def test_serve_answers_408_to_a_body_that_stops_but_waits_for_a_slow_one(serve):
    check_body_timeout(serve)
    # a body that keeps coming, each piece within the timeout, is read to its end (the timeout
    # is the longest gap, not the whole body's time)
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
    conn = connect(serve)
    conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())  # fmt: skip
    pieces = [body[i * len(body) // 4 : (i + 1) * len(body) // 4] for i in range(4)]
    for piece in pieces:
        time.sleep(BODY_TIMEOUT_S * 0.6)
        conn.sendall(piece)
    answer = answer_of(conn)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_serve_sheds_held_connections_so_a_normal_request_gets_in(serve):
    def completion() -> int:
        return httpx.post(serve + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                          timeout=30).status_code  # fmt: skip

    check_idle_connections_are_shed_for_new_ones(serve, 30, 6, completion)
    assert completion() == 200


def test_serve_task_embed_has_the_same_limits(tmp_path):
    srv = start_server(["--task", "embed", "--served-model-name", "embed", *serve_limits(12, 4)],
                       str(tmp_path / "embed.log"))  # fmt: skip
    try:
        check_head_timeouts(srv.base_url)
        check_body_timeout(srv.base_url, "/v1/embeddings")
        check_idle_connections_are_shed_for_new_ones(
            srv.base_url, 12, 4, lambda: httpx.post(srv.base_url + "/v1/embeddings", timeout=30,
                                                    json={"model": "embed", "input": "hi"}).status_code)  # fmt: skip
    finally:
        srv.stop()


def test_the_gateway_answers_408_to_heads_and_bodies_that_stop(gateway):
    check_head_timeouts(gateway)
    check_body_timeout(gateway)


def test_the_gateway_refuses_new_connections_only_when_its_caps_are_busy(gateway):
    """3 busy connections (whole requests waiting for a replica) from one address: its 4th is
    refused at once with 429; 8 busy in all: a new one from anywhere gets 503. Once they end,
    the gateway answers again."""
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 2}).encode()
    whole = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
             + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
    busy = []
    for source in ("127.0.0.2", "127.0.0.2", "127.0.0.2"):
        busy.append(connect(gateway, source))
        busy[-1].sendall(whole)
    time.sleep(0.5)  # read whole by the gateway
    over, waited = timed(lambda: answer_of(connect(gateway, "127.0.0.2")))
    assert over.startswith(b"HTTP/1.1 429") and error_code(over) == "too_many_connections" and waited < 1.5, over[:200]
    assert httpx.get(gateway + "/health").status_code == 200  # another address is not refused
    for source in ("127.0.0.3",) * 3 + ("127.0.0.4",) * 2:
        busy.append(connect(gateway, source))
        busy[-1].sendall(whole)
    time.sleep(0.5)
    full = answer_of(connect(gateway, "127.0.0.5"))
    assert full.startswith(b"HTTP/1.1 503") and error_code(full) == "too_many_connections", full[:200]
    assert all(map(still_open, busy))  # the busy ones are never shed
    for conn in busy:
        conn.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the gateway notices the clients left (it drops their requests)
        try:
            if httpx.get(gateway + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert httpx.get(gateway + "/health").status_code == 200


def test_llmserve_up_takes_the_limits_from_platform_yaml(tmp_path):
    """`llmserve up` with only an embedding model: the gateway section's limits hold on its port."""
    from up_utils import running_up

    platform = {"models": {"embed": {"kind": "embed"}}, "gateway": gateway_limits(12, 4)}
    (tmp_path / "platform.yaml").write_text(yaml.safe_dump(platform))
    with running_up(tmp_path, lambda health: all(health["upstreams"].values()),
                    "--config", str(tmp_path / "platform.yaml")) as up:  # fmt: skip
        url = up["url"]
        check_head_timeouts(url)
        check_body_timeout(url, "/v1/embeddings")
        check_idle_connections_are_shed_for_new_ones(
            url, 12, 4, lambda: httpx.post(url + "/v1/embeddings", timeout=30,
                                           json={"model": "embed", "input": "hi"}).status_code)  # fmt: skip
