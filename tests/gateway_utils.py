"""Start replicas on chosen ports (so one can come back where it was) and a gateway process."""

from __future__ import annotations

import os
import sys

import yaml
from server_utils import ServerProcess, spawn, wait_healthy


def spawn_replica(model_dir: str, name: str, port: int, log_path: str) -> ServerProcess:
    """A `llmserve serve` process on `port`; not yet waited for."""
    cmd = [
        sys.executable, "-m", "llmserve", "serve", "--model", model_dir, "--port", str(port),
        "--max-model-len", "256", "--served-model-name", name,
    ]  # fmt: skip
    return spawn(cmd, port, log_path)


def start_gateway(config: dict, port: int, tmp_dir: str) -> ServerProcess:
    path = os.path.join(tmp_dir, "gateway.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    cmd = [sys.executable, "-m", "llmserve", "gateway", "--config", path, "--port", str(port)]
    return wait_healthy(spawn(cmd, port, os.path.join(tmp_dir, "gateway.log")), 60.0)
