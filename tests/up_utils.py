"""Start `llmserve up` for real on free ports, wait for it, and stop it with everything it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
from server_utils import children, free_port, stop_process


@contextlib.contextmanager
def running_up(workdir, ready: Callable[[dict], bool], *extra: str, timeout: float = 300) -> Iterator[dict]:
    """`llmserve up` in `workdir` (its log: up.log), yielded once `ready(/health's JSON)`:
    {"url", "proc", "workdir", "ports"}. Left running by a test, it is stopped with SIGTERM and
    its descendants killed."""
    ports = {name: free_port() for name in ("gateway", "http", "grpc", "metrics")}
    cmd = [sys.executable, "-m", "llmserve", "up", *extra, "--port", str(ports["gateway"]),
           "--triton-http-port", str(ports["http"]), "--triton-grpc-port", str(ports["grpc"]),
           "--triton-metrics-port", str(ports["metrics"]), "--workdir", str(workdir)]  # fmt: skip
    log = open(workdir / "up.log", "w")  # noqa: SIM115 - the child writes to it for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{ports['gateway']}"
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, (workdir / "up.log").read_text()
        assert time.monotonic() < deadline, (workdir / "up.log").read_text()
        with contextlib.suppress(httpx.TransportError, ValueError):
            if ready(httpx.get(url + "/health", timeout=1).json()):
                break
        time.sleep(0.1)
    try:
        yield {"url": url, "proc": proc, "workdir": workdir, "ports": ports}
    finally:
        if proc.poll() is None:  # a test failed before stopping it: stop it the same way, leave nothing behind
            descendants = children(proc.pid, recursive=True)
            stop_process(proc, 60)
            for pid in descendants:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
