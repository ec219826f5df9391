"""Start replicas on chosen ports (so one can come back where it was) and a gateway process."""

from __future__ import annotations

import os
import socket
import sys
import time

import yaml
from server_utils import ServerProcess, spawn, wait_healthy


def spawn_replica(model_dir: str, name: str, port: int, log_path: str, *extra: str) -> ServerProcess:
    """A `llmserve serve` process on `port`; not yet waited for."""
    cmd = [
        sys.executable, "-m", "llmserve", "serve", "--model", model_dir, "--port", str(port),
        "--max-model-len", "256", "--served-model-name", name, *extra,
    ]  # fmt: skip
    return spawn(cmd, port, log_path)


def spawn_gateway(config: dict, port: int, tmp_dir: str, name: str = "gateway",
                  env: dict[str, str] | None = None) -> ServerProcess:  # fmt: skip
    """A `llmserve gateway` process on `port` (`env`: variables added); not yet waited for."""
    path = os.path.join(tmp_dir, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    cmd = [sys.executable, "-m", "llmserve", "gateway", "--config", path, "--port", str(port)]
    return spawn(cmd, port, os.path.join(tmp_dir, f"{name}.log"), env)


def start_gateway(config: dict, port: int, tmp_dir: str, name: str = "gateway") -> ServerProcess:
    return wait_healthy(spawn_gateway(config, port, tmp_dir, name), 60.0)


def start_redis(port: int, tmp_dir: str, timeout: float = 10.0) -> ServerProcess:
    """Debian's redis-server on 127.0.0.1:`port`, nothing persisted; waited for (PING)."""
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", tmp_dir]  # fmt: skip
    server = spawn(cmd, port, os.path.join(tmp_dir, f"redis-{port}.log"))
    server.base_url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server not up after {timeout} s:\n{server.log()}")
