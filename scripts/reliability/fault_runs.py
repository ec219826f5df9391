"""Documented fault runs on real processes (docs/reliability.md), on this machine's CPU with the
tiny shipped model: each fault under steady load, every request counted by outcome, and the
recovery time measured.

1. engine_core: `llmserve serve` under a supervisor loop (as Docker's `restart:` would), the
   engine core SIGKILLed mid-load: in-flight requests fail with a clear error, the server exits
   non-zero, the supervisor starts a fresh one; recovery = kill to /health 200 again.
2. replica: three `llmserve serve` replicas behind the gateway, one SIGKILLed mid-load and
   started again 15 s later: requests that had not started streaming must not fail; the
   breaker opens, and closes when the replica is back.
3. redis: the gateway with shared limits (rpm) in Redis, fail closed; Redis stopped for 15 s
   mid-load, then started again (empty): 503 limits_unavailable meanwhile, and the limits exact
   once it is back.

    .venv/bin/python scripts/reliability/fault_runs.py --output-json docs/fault_runs_2026-12-01.json
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "llmserve" / "assets" / "tiny_model")
PY = sys.executable
sys.path.insert(0, str(ROOT))
from llmserve.net import free_port  # noqa: E402 - after the checkout is on the path


def wait_http(url: str, timeout: float = 120.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic() - start
        time.sleep(0.05)
    raise RuntimeError(f"{url} not up after {timeout} s")


def serve_cmd(port: int, name: str = "tiny") -> list[str]:
    return [PY, "-m", "llmserve", "serve", "--model", TINY, "--port", str(port), "--max-model-len", "256",
            "--served-model-name", name, "--log-level", "warning"]  # fmt: skip


class Load:
    """Requests at a steady rate from a thread pool; each outcome recorded with its send time."""

    def __init__(self, url: str, rate: float, body: dict, headers: dict | None = None, stream_share: float = 0.5):
        self.url, self.rate, self.body, self.headers = url, rate, body, headers or {}
        self.stream_share = stream_share
        self.results: list[dict] = []
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(64)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.monotonic()

    def _one(self, i: int) -> None:
        sent = time.monotonic() - self.start
        stream = (i % 10) < self.stream_share * 10  # streams and whole bodies interleaved
        body = dict(self.body, stream=stream)
        outcome, started = "ok", False
        try:
            if stream:
                with httpx.stream("POST", self.url, json=body, headers=self.headers, timeout=120) as resp:
                    if resp.status_code != 200:
                        outcome = f"HTTP {resp.status_code}"
                    else:
                        for line in resp.iter_lines():
                            if line.startswith("data: {"):
                                started = True
                                if '"error"' in line:
                                    outcome = "stream error after start"
                            if line == "data: [DONE]":
                                break
            else:
                resp = httpx.post(self.url, json=body, headers=self.headers, timeout=120)
                if resp.status_code != 200:
                    code = ""
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        code = " " + str(resp.json()["error"]["code"])
                    outcome = f"HTTP {resp.status_code}{code}"
        except httpx.HTTPError as exc:
            outcome = f"{'after start' if started else 'before start'}: {type(exc).__name__}"
        self.results.append({"sent_s": round(sent, 2), "stream": stream, "outcome": outcome,
                             "took_s": round(time.monotonic() - self.start - sent, 2)})  # fmt: skip

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self._pool.submit(self._one, i)
            i += 1
            self._stop.wait(1.0 / self.rate)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)

    def counts(self) -> dict:
        return dict(collections.Counter(r["outcome"] for r in self.results))


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()
    return [int(p) for p in out]


def run_engine_core(workdir: Path) -> dict:
    """The core killed under load; a supervisor loop restarts the server when it exits."""
    port = free_port()
    log = open(workdir / "engine_core.log", "w")  # noqa: SIM115
    state = {"proc": subprocess.Popen(serve_cmd(port), stdout=log, stderr=subprocess.STDOUT), "exits": []}
    stop = threading.Event()

    def supervise() -> None:
        while not stop.is_set():
            code = state["proc"].poll()
            if code is not None:
                state["exits"].append({"code": code, "at": time.monotonic()})
                state["proc"] = subprocess.Popen(serve_cmd(port), stdout=log, stderr=subprocess.STDOUT)
            time.sleep(0.1)

    wait_http(f"http://127.0.0.1:{port}/health")
    sup = threading.Thread(target=supervise, daemon=True)
    sup.start()
    body = {"model": "tiny", "prompt": "a story", "max_tokens": 64, "ignore_eos": True}
    try:
        with Load(f"http://127.0.0.1:{port}/v1/completions", 4.0, body) as load:
            time.sleep(15)
            core = [c for c in children(state["proc"].pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
            killed_at = time.monotonic()
            os.kill(core[0], signal.SIGKILL)
            unhealthy = None
            while unhealthy is None and time.monotonic() - killed_at < 10:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code != 200:
                        unhealthy = time.monotonic() - killed_at
                time.sleep(0.02)
            while not state["exits"]:
                time.sleep(0.05)
            wait_http(f"http://127.0.0.1:{port}/health")
            healthy_again = time.monotonic() - killed_at
            time.sleep(15)
        kill_s = killed_at - load.start
    finally:
        stop.set()
        sup.join()
        state["proc"].send_signal(signal.SIGTERM)
        state["proc"].wait(30)
    return {"rate": 4.0, "duration_s": 30, "requests": len(load.results), "outcomes": load.counts(),
            "killed_at_s": round(kill_s, 1), "health_unhealthy_after_s": unhealthy,
            "exit_code": state["exits"][0]["code"], "exit_after_kill_s": round(state["exits"][0]["at"] - killed_at, 2),
            "healthy_again_after_s": round(healthy_again, 1),
            "failed": [r for r in load.results if r["outcome"] != "ok"]}  # fmt: skip


def run_replica(workdir: Path) -> dict:
    """Three replicas behind a gateway; one killed mid-load and started again 15 s later."""
    ports = [free_port() for _ in range(3)]
    logs = [open(workdir / f"replica{i}.log", "w") for i in range(3)]  # noqa: SIM115
    procs = [subprocess.Popen(serve_cmd(p), stdout=log, stderr=subprocess.STDOUT) for p, log in zip(ports, logs)]
    for p in ports:
        wait_http(f"http://127.0.0.1:{p}/health")
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    gw_port = free_port()
    config = workdir / "gateway.yaml"
    config.write_text(json.dumps({"models": {"tiny": {"replicas": urls}},
                                  "health": {"interval_s": 0.5, "timeout_s": 0.5, "failure_threshold": 2}}))  # fmt: skip
    gw_log = open(workdir / "gateway.log", "w")  # noqa: SIM115
    gateway = subprocess.Popen([PY, "-m", "llmserve", "gateway", "--config", str(config), "--port", str(gw_port)],
                               stdout=gw_log, stderr=subprocess.STDOUT)  # fmt: skip
    gw = f"http://127.0.0.1:{gw_port}"
    wait_http(gw + "/health")
    body = {"model": "tiny", "prompt": "a story", "max_tokens": 64, "ignore_eos": True}
    breaker_open = breaker_closed = None
    try:
        with Load(gw + "/v1/completions", 6.0, body) as load:
            time.sleep(15)
            killed_at = time.monotonic()
            procs[1].kill()
            procs[1].wait()
            while breaker_open is None and time.monotonic() - killed_at < 15:
                if not httpx.get(gw + "/health", timeout=2).json()["upstreams"][urls[1]]:
                    breaker_open = time.monotonic() - killed_at
                time.sleep(0.05)
            time.sleep(max(0.0, 15 - (time.monotonic() - killed_at)))
            restarted_at = time.monotonic()
            procs[1] = subprocess.Popen(serve_cmd(ports[1]), stdout=logs[1], stderr=subprocess.STDOUT)
            while breaker_closed is None and time.monotonic() - restarted_at < 120:
                if httpx.get(gw + "/health", timeout=2).json()["upstreams"][urls[1]]:
                    breaker_closed = time.monotonic() - restarted_at
                time.sleep(0.05)
            time.sleep(10)
        kill_s = killed_at - load.start
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(30)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    retries = [line for line in (workdir / "gateway.log").read_text().splitlines() if "breaker" in line]
    return {"rate": 6.0, "requests": len(load.results), "outcomes": load.counts(), "killed_at_s": round(kill_s, 1),
            "breaker_open_after_s": None if breaker_open is None else round(breaker_open, 2),
            "restarted_15_s_later_breaker_closed_after_s": None if breaker_closed is None else round(breaker_closed, 2),
            "gateway_breaker_log": retries, "failed": [r for r in load.results if r["outcome"] != "ok"]}  # fmt: skip


def run_redis(workdir: Path) -> dict:
    """Shared limits in Redis (fail closed); Redis stopped for 15 s mid-load, then started empty."""
    port = free_port()
    redis_cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(workdir)]  # fmt: skip
    redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    replica_port = free_port()
    replica = subprocess.Popen(serve_cmd(replica_port), stdout=open(workdir / "redis_replica.log", "w"),  # noqa: SIM115
                               stderr=subprocess.STDOUT)  # fmt: skip
    wait_http(f"http://127.0.0.1:{replica_port}/health")
    from llmserve.gateway.config import hash_key

    rpm = 120
    config = workdir / "gateway_redis.yaml"
    config.write_text(json.dumps({
        "models": {"tiny": {"replicas": [f"http://127.0.0.1:{replica_port}"]}},
        "keys": [{"name": "load", "sha256": hash_key("sk-load"), "rpm": rpm}, {"name": "probe", "sha256": hash_key("sk-probe"), "rpm": 5}],
        "limits": {"backend": "redis", "url": f"redis://127.0.0.1:{port}/0", "timeout_s": 0.5, "fail_open": False},
    }))  # fmt: skip
    gw_port = free_port()
    gateway = subprocess.Popen(
        [PY, "-m", "llmserve", "gateway", "--config", str(config), "--port", str(gw_port)],
        stdout=open(workdir / "gateway_redis.log", "w"),
        stderr=subprocess.STDOUT,
    )  # noqa: SIM115
    gw = f"http://127.0.0.1:{gw_port}"
    wait_http(gw + "/health")
    body = {"model": "tiny", "prompt": "a story", "max_tokens": 16, "ignore_eos": True}
    try:
        with Load(gw + "/v1/completions", 4.0, body, {"Authorization": "Bearer sk-load"}) as load:
            time.sleep(15)
            stopped_at = time.monotonic()
            redis.terminate()
            redis.wait()
            time.sleep(15)
            redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            restarted_at = time.monotonic()
            first_ok = None
            while first_ok is None and time.monotonic() - restarted_at < 30:
                if load.results and any(r["outcome"] == "ok" and r["sent_s"] >= restarted_at - load.start
                                        for r in list(load.results)):  # fmt: skip
                    first_ok = time.monotonic() - restarted_at
                time.sleep(0.05)
            # exact again: 8 requests at once on a fresh key of rpm 5
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                probe = list(pool.map(lambda _: httpx.post(gw + "/v1/completions", json=dict(body, stream=False),
                                                           headers={"Authorization": "Bearer sk-probe"}, timeout=60).status_code,
                                      range(8)))  # fmt: skip
            time.sleep(10)
        stop_s = stopped_at - load.start
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(30)
        replica.send_signal(signal.SIGTERM)
        replica.wait(30)
        redis.terminate()
        redis.wait()
    down = [r for r in load.results if stop_s <= r["sent_s"] < stop_s + 15]
    return {"rate": 4.0, "rpm_of_the_load_key": rpm, "requests": len(load.results), "outcomes": load.counts(),
            "stopped_at_s": round(stop_s, 1), "while_down": dict(collections.Counter(r["outcome"] for r in down)),
            "first_ok_after_restart_s": None if first_ok is None else round(first_ok, 2),
            "probe_after_return_rpm5_8_at_once": sorted(probe)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="engine_core,replica,redis")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    runs = {"engine_core": run_engine_core, "replica": run_replica, "redis": run_redis}
    report = {"date": time.strftime("%Y-%m-%d"), "cpu_cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            print(f"--- {name}", flush=True)
            work = Path(tmp) / name
            work.mkdir()
            report[name] = runs[name](work)
            summary = {k: v for k, v in report[name].items() if k != "failed"}
            print(json.dumps(summary, indent=1), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
