"""Start replicas on chosen ports (so one can come back where it was) and a gateway process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import yaml
from server_utils import ServerProcess


def _wait_healthy(server: ServerProcess, timeout: float) -> ServerProcess:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"process exited ({server.proc.returncode}):\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"not healthy after {timeout} s:\n{server.log()}")


def _spawn(cmd: list[str], port: int, log_path: str) -> ServerProcess:
    log = open(log_path, "w")  # noqa: SIM115 - the child process writes to it for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


def spawn_replica(model_dir: str, name: str, port: int, log_path: str) -> ServerProcess:
    """A `llmserve serve` process on `port`; not yet waited for."""
    cmd = [
        sys.executable, "-m", "llmserve", "serve", "--model", model_dir, "--port", str(port),
        "--max-model-len", "256", "--served-model-name", name,
    ]  # fmt: skip
    return _spawn(cmd, port, log_path)


def wait_healthy(server: ServerProcess, timeout: float = 120.0) -> ServerProcess:
    return _wait_healthy(server, timeout)


def start_gateway(config: dict, port: int, tmp_dir: str) -> ServerProcess:
    path = os.path.join(tmp_dir, "gateway.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    cmd = [sys.executable, "-m", "llmserve", "gateway", "--config", path, "--port", str(port)]
    return _wait_healthy(_spawn(cmd, port, os.path.join(tmp_dir, "gateway.log")), 60.0)
