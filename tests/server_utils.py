"""Start a real `llmserve serve` process on 127.0.0.1 and wait until it is healthy; and scripted
stub servers standing in for misbehaving peers."""

from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from llmserve.net import free_port  # noqa: F401 - the tests' import of it
from llmserve.processes import stop_process


def children(pid: int, recursive: bool = False) -> list[int]:
    """The process ids of `pid`'s children (with `recursive`, of all its descendants)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in map(int, (task / "children").read_text().split()):
            found += [child, *(children(child, True) if recursive else [])]
    return found


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 15.0) -> int:
        return stop_process(self.proc, timeout)


def spawn(cmd: list[str], port: int, log_path: str, env: dict[str, str] | None = None) -> ServerProcess:
    """Start a server process whose output goes to `log_path` (`env`: variables added to
    this process's); not yet waited for."""
    log = open(log_path, "w")  # the child writes to it for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(server: ServerProcess, timeout: float = 120.0) -> ServerProcess:
    """Poll /health until 200; raise (with the log) if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"process exited ({server.proc.returncode}):\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # short: the suite starts dozens of servers
    server.stop()
    raise RuntimeError(f"not healthy after {timeout} s:\n{server.log()}")


def start_server(
    args: list[str], log_path: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve", "serve", "--port", str(port), *args]
    return wait_healthy(spawn(cmd, port, log_path, env), timeout)


def metric(base_url: str, name: str) -> float:
    """Sum of a metric's samples in /metrics (all label sets)."""
    total, found = 0.0, False
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(f"{name} not in /metrics")
    return total


def raw_http(base_url: str, head: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send bytes as they are (a request head the HTTP clients would not build) and read the
    whole answer until the server closes or `timeout` passes."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as conn:
        try:
            conn.sendall(head + body)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before reading it all
            pass
        chunks = []
        try:
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


def big_header_request(path: str, header_bytes: int, keep_alive: bool = False) -> bytes:
    connection = b"keep-alive" if keep_alive else b"close"
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode() + b"a" * header_bytes
            + b"\r\nConnection: " + connection + b"\r\n\r\n")  # fmt: skip


class StubHandler(http.server.BaseHTTPRequestHandler):
    """The handler of a scripted HTTP server standing in for a misbehaving peer: quiet, and
    `reply` sends a whole answer."""

    def log_message(self, *args) -> None:
        pass

    def reply(self, body: bytes, content_type: str = "application/json", status: int = 200) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def stub_server(handler: type[StubHandler], **attrs) -> Iterator[http.server.ThreadingHTTPServer]:
    """`handler` serving on a free port in a thread (`attrs` set on the server, for the handler
    to read as `self.server.<name>`), shut down afterwards."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in attrs.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
