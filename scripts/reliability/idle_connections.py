"""The held-connections attack of issue 49 on a real server (docs/reliability.md): thousands of
connections that send half a request head and then nothing, and slow ones that send one more
byte every few seconds, while a normal request (a completion of 8 tokens, a new connection
each time) is timed every half second. Then the attack stops, and the time until the server
answers normally again is measured.

The target is `llmserve serve` with the tiny shipped model, or `llmserve gateway` in front of
one (the attack goes to the gateway's port). The attacking connections come from `--sources`
loopback addresses (127.0.0.2 ...), so a cap per client address alone cannot stop them; the
normal requests come from 127.0.0.1. The attack runs in worker processes, each holding its
share of connections (one process may not open them all under its open-file limit), opening
at most `--rate` a second; with `--reconnect-s` a connection the server closes is opened again
(a persistent attacker: any file the server frees is taken again).

    .venv/bin/python scripts/reliability/idle_connections.py --target serve --reconnect-s 2 --output-json out.json
    cd /tmp/before && PYTHONPATH=/tmp/before .venv/bin/python scripts/reliability/idle_connections.py ...  # older code
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from fault_runs import serve_cmd, wait_http  # noqa: E402 - the same tiny server as the fault runs

from llmserve.net import free_port  # noqa: E402

HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
SLOW_EVERY_S = 5.0


def hold_connections(worker: int, workers: int, idle: int, slow: int, sources: int, port: int, reconnect_s: float,
                     rate: float, stop, status) -> None:  # fmt: skip
    """One attacking process: its share of the idle and slow connections, held until `stop`
    (with `reconnect_s` > 0, one the server closes is opened again that long after); every
    second it reports how many the server still holds open."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    counts = {"open": 0, "opened": 0, "failed": 0, "closed_by_server": 0}

    pace = Pace(rate / workers)

    async def one(i: int, is_slow: bool, gate: asyncio.Semaphore) -> None:
        await hold(i, is_slow, gate)
        while reconnect_s > 0:
            await asyncio.sleep(reconnect_s)
            await hold(i, is_slow, gate)

    async def hold(i: int, is_slow: bool, gate: asyncio.Semaphore) -> None:
        source = f"127.0.0.{2 + i % sources}"
        await pace.wait()
        async with gate:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 15
                )
                writer.write(HALF_HEAD)
            except (TimeoutError, OSError):
                counts["failed"] += 1
                return
        counts["open"] += 1
        counts["opened"] += 1
        try:
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(4096), SLOW_EVERY_S if is_slow else None)
                except TimeoutError:
                    writer.write(b"x")  # one more byte of a header that never ends
                    continue
                except OSError:
                    data = b""
                if not data:  # the server closed it (an answer, if any, came before)
                    counts["closed_by_server"] += 1
                    return
        finally:
            counts["open"] -= 1
            writer.close()

    async def main() -> None:
        gate = asyncio.Semaphore(128)  # connects in flight at once
        tasks = [asyncio.create_task(one(i, i >= idle, gate)) for i in range(idle + slow) if i % workers == worker]
        while not stop.is_set():
            status.put((worker, time.time(), dict(counts)))
            await asyncio.sleep(1.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        status.put((worker, time.time(), dict(counts)))

    asyncio.run(main())


class Pace:
    """At most `rate` starts a second (0: no limit), evenly spaced."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.next = time.monotonic()

    async def wait(self) -> None:
        if self.interval:
            now = time.monotonic()
            slot, self.next = max(self.next, now), max(self.next, now) + self.interval
            await asyncio.sleep(slot - now)


class Probe(threading.Thread):
    """A normal request every `every_s`, each on a new connection, its outcome and time recorded."""

    def __init__(self, url: str, every_s: float = 0.5, timeout_s: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s, self.timeout_s = url, every_s, timeout_s
        self.results: list[dict] = []
        self.halt = threading.Event()

    def once(self) -> dict:
        start = time.time()
        try:
            resp = httpx.post(self.url + "/v1/completions", timeout=self.timeout_s,
                              json={"model": "tiny", "prompt": "hello there", "max_tokens": 8, "ignore_eos": True})  # fmt: skip
            outcome = str(resp.status_code)
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        return {"t": start, "outcome": outcome, "latency_s": time.time() - start}

    def run(self) -> None:
        while not self.halt.is_set():
            self.results.append(self.once())
            self.halt.wait(max(0.0, self.every_s - self.results[-1]["latency_s"]))


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU time so far."""
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def open_files(pid: int) -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return -1


def start_target(target: str, workdir: str) -> tuple[list[subprocess.Popen], str, int]:
    """The server(s), started and healthy: (processes, the URL attacked, the pid that holds its port)."""
    log = open(os.path.join(workdir, "serve.log"), "w")
    port = free_port()
    serve = subprocess.Popen(serve_cmd(port), stdout=log, stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/health")
    if target == "serve":
        return [serve], f"http://127.0.0.1:{port}", serve.pid
    gw_port = free_port()
    config = os.path.join(workdir, "gateway.yaml")
    with open(config, "w") as f:
        json.dump({"models": {"tiny": {"replicas": [f"http://127.0.0.1:{port}"]}}}, f)  # YAML reads JSON
    gateway = subprocess.Popen([sys.executable, "-m", "llmserve", "gateway", "--config", config, "--port", str(gw_port),
                                "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    wait_http(f"http://127.0.0.1:{gw_port}/health")
    return [serve, gateway], f"http://127.0.0.1:{gw_port}", gateway.pid


def summary(results: list[dict], usual_s: float) -> dict:
    ok = [r["latency_s"] for r in results if r["outcome"] == "200"]
    return {"requests": len(results), "ok": len(ok),
            "within_2x": sum(latency <= 2 * usual_s for latency in ok),
            "failed": {o: sum(r["outcome"] == o for r in results) for o in {r["outcome"] for r in results} - {"200"}},
            "p50_s": round(statistics.median(ok), 3) if ok else None, "max_s": round(max(ok), 3) if ok else None}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    workdir = tempfile.mkdtemp(prefix="idle-connections-")
    procs, url, pid = start_target(args.target, workdir)
    try:
        probe = Probe(url)
        for _ in range(3):
            probe.once()  # warm-up
        usual = statistics.median(probe.once()["latency_s"] for _ in range(20))
        fds_before, load = open_files(pid), os.getloadavg()[0]
        print(f"usual time of a normal request: {usual * 1000:.0f} ms; the server holds {fds_before} files")
        stop = multiprocessing.Event()
        status: multiprocessing.Queue = multiprocessing.Queue()
        port = int(url.rsplit(":", 1)[1])
        workers = [multiprocessing.Process(target=hold_connections, daemon=True,
                                           args=(w, args.workers, args.idle, args.slow, args.sources, port,
                                                 args.reconnect_s, args.rate, stop, status))
                   for w in range(args.workers)]  # fmt: skip
        attack_start = time.time()
        probe.start()
        for w in workers:
            w.start()
        attackers = [w.pid for w in workers]
        timeline, latest = [], {}
        cpu = [time.time(), cpu_seconds(pid), 0.0]  # when, the server's CPU time, the attack's

        def sample(phase: str) -> None:
            while not status.empty():
                worker, _, counts = status.get()
                latest[worker] = counts
            held = {k: sum(c[k] for c in latest.values()) for k in ("open", "opened", "failed", "closed_by_server")}
            now, used, attack = time.time(), cpu_seconds(pid), sum(map(cpu_seconds, attackers))
            span = max(now - cpu[0], 1e-6)
            busy, attack_busy = (used - cpu[1]) / span, max(0.0, attack - cpu[2]) / span  # 0 once they end
            cpu[:] = [now, used, attack]
            timeline.append({"t": round(time.time() - attack_start, 1), "phase": phase, "server_open_files": open_files(pid),
                             "server_cpu_percent": round(100 * busy), "attack_cpu_percent": round(100 * attack_busy),
                             "attack_connections_held_open": held["open"], "attack_opened": held["opened"],
                             "attack_connect_failed": held["failed"], "attack_closed_by_server": held["closed_by_server"]})  # fmt: skip
            print(timeline[-1], flush=True)

        while time.time() - attack_start < args.attack_s:
            time.sleep(2.0)
            sample("attack")
        stop.set()
        attack_end = time.time()
        for w in workers:
            w.join(30)
        while time.time() - attack_end < args.recovery_s:
            time.sleep(2.0)
            sample("after")
        probe.halt.set()
        probe.join()
        during = [r for r in probe.results if attack_start <= r["t"] < attack_end]
        after = [r for r in probe.results if r["t"] >= attack_end]
        # the attack holds from when all its connections were opened (or the server took no more)
        target = args.idle + args.slow
        ramp_end = attack_start + next((s["t"] for s in timeline if s["attack_opened"] + s["attack_connect_failed"] >= target
                                        or s["phase"] == "after"), args.attack_s)  # fmt: skip
        recovered = next((r["t"] + r["latency_s"] - attack_end for r in after
                          if r["outcome"] == "200" and r["latency_s"] <= 2 * usual), None)  # fmt: skip
        return {
            "target": args.target, "idle": args.idle, "slow": args.slow, "sources": args.sources,
            "reconnect_s": args.reconnect_s, "rate": args.rate,
            "attack_s": args.attack_s, "opened_all_after_s": round(ramp_end - attack_start, 1),
            "load_average_at_start": load, "usual_s": round(usual, 3), "server_open_files_before": fds_before,
            "while_opening": summary([r for r in during if r["t"] < ramp_end], usual),
            "while_held": summary([r for r in during if r["t"] >= ramp_end], usual),
            "after": summary(after, usual),
            "recovered_within_2x_after_s": None if recovered is None else round(recovered, 2),
            "timeline": timeline, "probes": probe.results,
        }  # fmt: skip
    finally:
        for proc in reversed(procs):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            if proc.poll() is None:
                proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=["serve", "gateway"], default="serve")
    p.add_argument("--idle", type=int, default=19_990, help="connections that send half a head, then nothing")
    p.add_argument("--slow", type=int, default=200, help=f"connections that send a byte every {SLOW_EVERY_S:g} s")
    p.add_argument("--sources", type=int, default=200, help="loopback addresses the attack comes from")
    p.add_argument("--workers", type=int, default=4, help="attacking processes")
    p.add_argument("--rate", type=float, default=1000.0,
                   help="new connections a second (the first ones and those opened again), all workers together "
                        "(0: as fast as they can)")  # fmt: skip
    p.add_argument(
        "--reconnect-s",
        type=float,
        default=0.0,
        help="a connection the server closes is opened again this long after (0: not again)",
    )
    p.add_argument("--attack-s", type=float, default=90.0, help="how long the attack lasts")
    p.add_argument("--recovery-s", type=float, default=20.0, help="how long to watch after it stops")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k not in ("timeline", "probes")}, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
