"""The abandoned-requests attack of issue 49 on a real `llmserve up` (docs/reliability.md):
clients that ask for a long whole answer (2,000 tokens, `ignore_eos`) and leave after a few
seconds, as `curl -m 3` or an impatient client does, while a normal request (a chat answer of
32 tokens, temperature 0) is timed every two seconds.

Phases: the normal request alone (its usual time); a burst of `--burst` abandoned requests at
once (the openai client's retries made about two dozen of the issue's six); then `--attackers`
clients that each send one and leave, again and again, for `--attack-s`; then nothing, for
`--recover-s`. It records each normal request's time and status, and the engine's running
requests from the gateway's /metrics where it has them (the platform before this fix had
none). It starts the platform itself (the default models; `--workdir` for its files).

    .venv/bin/python scripts/reliability/abandoned_requests.py --output-json out.json
    PYTHONPATH=/tmp/before .venv/bin/python scripts/reliability/abandoned_requests.py ...   # older code
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

NORMAL = {"model": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}],
          "max_tokens": 32, "temperature": 0}  # fmt: skip
LONG = {"model": "chat", "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}


def start_up(workdir: Path) -> tuple[subprocess.Popen, str]:
    from llmserve.net import free_port

    port = free_port()
    ports = [str(free_port()) for _ in range(3)]
    cmd = [sys.executable, "-m", "llmserve", "up", "--port", str(port), "--triton-http-port", ports[0],
           "--triton-grpc-port", ports[1], "--triton-metrics-port", ports[2], "--workdir", str(workdir)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(workdir / "up.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError, ValueError):
            health = httpx.get(url + "/health", timeout=1).json()
            if health.get("upstreams") and all(health["upstreams"].values()):
                return proc, url
        if proc.poll() is not None:
            raise SystemExit(f"llmserve up exited: {(workdir / 'up.log').read_text()[-2000:]}")
        time.sleep(0.5)
    raise SystemExit("llmserve up was not ready within 600 s")


def abandon(url: str, leave_after_s: float) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + "/v1/completions", json=LONG, timeout=httpx.Timeout(leave_after_s))


def running(url: str) -> float | None:
    """The chat engine's running requests, as the gateway's /metrics passes them on (None: not there)."""
    try:
        lines = httpx.get(url + "/metrics", timeout=5).text.splitlines()
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_running{")]
    return sum(values) if values else None


class Prober:
    """Times a normal request every `every_s` seconds, in its own thread, each tagged with the phase."""

    def __init__(self, url: str, every_s: float, timeout_s: float) -> None:
        self.url, self.every_s, self.timeout_s = url, every_s, timeout_s
        self.phase = "baseline"
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> Prober:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            phase = self.phase
            try:
                resp = httpx.post(self.url + "/v1/chat/completions", json=NORMAL, timeout=self.timeout_s)
                status = resp.status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            took = time.monotonic() - start
            self.rows.append({"t": round(start - self.t0, 2), "phase": phase, "status": status,
                              "seconds": round(took, 3), "engine_running": running(self.url)})  # fmt: skip
            self._stop.wait(max(0.0, self.every_s - took))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst", type=int, default=24)
    p.add_argument("--attackers", type=int, default=6)
    p.add_argument("--leave-after-s", type=float, default=3.0)
    p.add_argument("--baseline-s", type=float, default=30.0)
    p.add_argument("--attack-s", type=float, default=60.0)
    p.add_argument("--recover-s", type=float, default=60.0)
    p.add_argument("--probe-timeout-s", type=float, default=60.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="abandoned-"))
    workdir.mkdir(parents=True, exist_ok=True)
    proc, url = start_up(workdir)
    try:
        httpx.post(url + "/v1/chat/completions", json=NORMAL, timeout=120)  # warm
        prober = Prober(url, 2.0, args.probe_timeout_s).start()
        time.sleep(args.baseline_s)
        prober.phase = "after burst"
        burst = [threading.Thread(target=abandon, args=(url, args.leave_after_s)) for _ in range(args.burst)]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        time.sleep(args.attack_s / 2)
        prober.phase = "under attack"
        stop = threading.Event()

        def attacker() -> None:
            while not stop.is_set():
                abandon(url, args.leave_after_s)

        attackers = [threading.Thread(target=attacker) for _ in range(args.attackers)]
        for t in attackers:
            t.start()
        time.sleep(args.attack_s)
        stop.set()
        for t in attackers:
            t.join()
        prober.phase = "recovery"
        time.sleep(args.recover_s)
        prober.stop()
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    rows = prober.rows
    usual = statistics.median(r["seconds"] for r in rows if r["phase"] == "baseline" and r["status"] == 200)
    summary = {}
    for phase in ("baseline", "after burst", "under attack", "recovery"):
        mine = [r for r in rows if r["phase"] == phase]
        ok = [r["seconds"] for r in mine if r["status"] == 200]
        summary[phase] = {
            "requests": len(mine), "succeeded": len(ok),
            "median_s": round(statistics.median(ok), 3) if ok else None, "max_s": round(max(ok), 3) if ok else None,
            "max_over_usual": round(max(ok) / usual, 2) if ok else None,
        }  # fmt: skip
    result = {"args": vars(args), "usual_s": usual, "summary": summary, "rows": rows}
    print(json.dumps(summary, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
