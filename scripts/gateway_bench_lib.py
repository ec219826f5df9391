"""Shared by the gateway benchmarks: start processes on free ports, wait for them, read metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # llmserve from this checkout, as the processes started below use
from llmserve.net import free_port  # noqa: E402
from llmserve.processes import stop_process  # noqa: E402


@dataclass
class Proc:
    proc: subprocess.Popen
    url: str
    log: str

    def stop(self) -> None:
        stop_process(self.proc, 20)


def start(args: list[str], port: int, log: str) -> Proc:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=ROOT)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return Proc(proc, f"http://127.0.0.1:{port}", log)


def llmserve(args: list[str], log: str) -> Proc:
    port = free_port()
    return start(["-m", "llmserve", *args, "--port", str(port)], port, log)


def gateway(config: dict, workdir: str, name: str = "gateway", log_level: str = "warning") -> Proc:
    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return llmserve(["gateway", "--config", path, "--log-level", log_level], os.path.join(workdir, f"{name}.log"))


def wait_healthy(*procs: Proc, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        while True:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.url} exited; log: {p.log}")
            try:
                if httpx.get(p.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{p.url} not healthy; log: {p.log}")
            time.sleep(0.2)


def wait_upstreams_up(gw: Proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(httpx.get(gw.url + "/health").json()["upstreams"].values()):
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway does not see its upstreams up")
        time.sleep(0.1)


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples (all label sets)."""
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))
