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
def running_up(workdir, ready: Callable[[dict], bool], *extra: str, timeout: float = 300,
               own_workdir: bool = False) -> Iterator[dict]:  # fmt: skip
    """`llmserve up` in `workdir` (its log: up.log), yielded once `ready(/health's JSON)`:
    {"url", "proc", "workdir", "platform_dir", "ports"}. `platform_dir` holds the model
    repository and triton.log: `workdir` itself (--workdir), or with `own_workdir` the temporary
    folder `up` makes itself (no --workdir; TMPDIR is `workdir`). Left running by a test, it is
    stopped with SIGTERM and its descendants killed."""
    ports = {name: free_port() for name in ("gateway", "http", "grpc", "metrics")}
    cmd = [sys.executable, "-m", "llmserve", "up", *extra, "--port", str(ports["gateway"]),
           "--triton-http-port", str(ports["http"]), "--triton-grpc-port", str(ports["grpc"]),
           "--triton-metrics-port", str(ports["metrics"])]  # fmt: skip
    cmd += [] if own_workdir else ["--workdir", str(workdir)]
    log = open(workdir / "up.log", "w")  # noqa: SIM115 - the child writes to it for its whole life
    env = {**os.environ, "TMPDIR": str(workdir)} if own_workdir else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{ports['gateway']}"
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, (workdir / "up.log").read_text()
        assert time.monotonic() < deadline, (workdir / "up.log").read_text()
        with contextlib.suppress(httpx.TransportError, ValueError):
            if ready(httpx.get(url + "/health", timeout=1).json()):
                break
        time.sleep(0.1)
    platform_dir = workdir
    if own_workdir:
        made = list(workdir.glob("llmserve-up-*"))
        assert len(made) == 1, made
        platform_dir = made[0]
    try:
        yield {"url": url, "proc": proc, "workdir": workdir, "platform_dir": platform_dir, "ports": ports}
    finally:
        if proc.poll() is None:  # a test failed before stopping it: stop it the same way, leave nothing behind
            descendants = children(proc.pid, recursive=True)
            stop_process(proc, 60)
            for pid in descendants:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
