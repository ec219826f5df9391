"""deploy/ against running parts: a real Prometheus scraping a real `llmserve serve`, gateway
and Triton server; every dashboard and alert query checked against their live /metrics; the
gateway's status page in headless chromium while load runs; the nginx example proxying."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx
import pytest
import yaml
from browser_utils import Browser
from deploy_utils import (
    DEPLOY,
    exported_metric_names,
    load_dashboard_builder,
    promql_metric_names,
    tool,
)
from gateway_utils import start_gateway
from server_utils import ServerProcess, free_port, spawn, wait_healthy
from triton_utils import echo_infer, echo_repo

from llmserve.config import TINY_MODEL_DIR
from llmserve.triton.server import TritonServer

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[1] / "docs"
MODEL = "llmserve-tiny"  # the tiny test model's served name


@dataclass
class Platform:
    server: ServerProcess
    gateway: ServerProcess
    triton: TritonServer
    prometheus: ServerProcess  # started with the others: its first scrape comes seconds after start
    tmp: Path

    @property
    def triton_metrics(self) -> str:
        return f"http://127.0.0.1:{self.triton.metrics_port}/metrics"


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """A server (the tiny model), a gateway in front of it, a Triton server and a Prometheus
    scraping all three, started together."""
    tmp = tmp_path_factory.mktemp("deploy")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llmserve",
        "serve",
        str(TINY_MODEL_DIR),
        "--port",
        str(port),
        "--max-model-len",
        "512",
    ]
    server = spawn(cmd, port, str(tmp / "server.log"))
    triton = TritonServer(
        str(echo_repo(tmp / "repo")), http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        exit_timeout_secs=2, log_path=str(tmp / "triton.log"),
    ).start()  # fmt: skip
    config = {"models": {"chat": {"replicas": [server.base_url], "model": MODEL}},
              "health": {"interval_s": 0.3, "timeout_s": 1.0, "failure_threshold": 1}}  # fmt: skip
    gateway_port = free_port()
    prometheus = _start_prometheus(tmp, {
        "llmserve-engine": server.base_url, "llmserve-gateway": f"http://127.0.0.1:{gateway_port}",
        "triton": f"http://127.0.0.1:{triton.metrics_port}",
    })  # fmt: skip
    gateway = None
    try:
        gateway = start_gateway(config, gateway_port, str(tmp))
        wait_healthy(server)
        triton.wait_ready(timeout=60)
        _wait(lambda: all(httpx.get(gateway.base_url + "/health").json()["upstreams"].values()), 10,
              "the gateway sees the server healthy")  # fmt: skip
        _wait(lambda: _ready(prometheus), 20, "Prometheus ready")
        yield Platform(server, gateway, triton, prometheus, tmp)
    finally:
        for process in (gateway, server, prometheus):
            if process is not None:
                process.stop()
        triton.stop()


def _complete(base_url: str, max_tokens: int = 16, stream: bool = False, model: str = "chat") -> httpx.Response:
    body = {"model": model, "prompt": "The json module", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}  # fmt: skip
    resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


# --- Prometheus -----------------------------------------------------------------------------


def _start_prometheus(tmp: Path, targets: dict[str, str]) -> ServerProcess:
    """deploy/prometheus/prometheus.yml and its rules, with the targets pointed at this test's processes."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / "prometheus" / "rules" / "*.yml")]
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets.pop(job["job_name"]).removeprefix("http://")]}]
    assert not targets, f"jobs missing from prometheus.yml: {targets}"
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    cmd = [tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]  # fmt: skip
    return spawn(cmd, port, str(tmp / "prometheus.log"))


def _ready(proc: ServerProcess) -> bool:
    assert proc.proc.poll() is None, proc.log()
    try:
        return httpx.get(proc.base_url + "/-/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _query(prometheus: ServerProcess, expr: str) -> list[dict]:
    resp = httpx.get(prometheus.base_url + "/api/v1/query", params={"query": expr}, timeout=5).json()
    assert resp["status"] == "success", (expr, resp)
    return resp["data"]["result"]


def test_prometheus_scrapes_engine_gateway_and_triton(platform):
    prometheus = platform.prometheus
    _complete(platform.gateway.base_url, max_tokens=8)  # through the gateway: both count it
    echo_infer(platform.triton.url)
    series = _wait(lambda: [r for r in _query(prometheus, "vllm:generation_tokens_total") if float(r["value"][1]) >= 8],
                   15, "vllm:generation_tokens_total scraped after a request")  # fmt: skip
    assert series[0]["metric"]["job"] == "llmserve-engine" and series[0]["metric"]["model_name"] == MODEL

    def up() -> dict[str, str]:
        return {r["metric"]["job"]: r["value"][1] for r in _query(prometheus, "up")}

    _wait(lambda: len(up()) == 3, 5, "every target scraped")
    assert up() == {"llmserve-engine": "1", "llmserve-gateway": "1", "triton": "1"}
    _wait(lambda: _query(prometheus, 'llmserve_gateway_requests_total{alias="chat", status="200"}'), 5, "gateway")
    _wait(lambda: _query(prometheus, 'nv_inference_request_success{model="echo"} > 0'), 5, "Triton's metrics")

    # the shipped rules load and evaluate in the real Prometheus
    groups = httpx.get(prometheus.base_url + "/api/v1/rules").json()["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert {"LLMServeKVCacheNearlyFull", "TritonQueueDurationGrowing", "llmserve:queue_time_seconds:p99_5m"} <= set(
        rules
    )
    _wait(lambda: all(r["health"] == "ok" for g in httpx.get(prometheus.base_url + "/api/v1/rules").json()["data"]
                      ["groups"] for r in g["rules"]), 5, "every rule evaluated without error")  # fmt: skip

    # every dashboard query is valid PromQL for this Prometheus (Grafana's variables filled in)
    for _board, expr in _dashboard_queries():
        expr = expr.replace("$__rate_interval", "1m").replace('"$job"', '".*"').replace('"$model"', '".*"')
        _query(prometheus, expr)


# --- metric names ---------------------------------------------------------------------------


def _dashboard_queries() -> list[tuple[str, str]]:
    builder = load_dashboard_builder()
    return [(name, t["expr"]) for name, board in builder.DASHBOARDS.items()
            for panel in board["panels"] for t in panel["targets"]]  # fmt: skip


def _live_names(platform: Platform) -> set[str]:
    pages = [httpx.get(platform.server.base_url + "/metrics").text, httpx.get(platform.gateway.base_url + "/metrics").text,
             httpx.get(platform.triton_metrics).text]  # fmt: skip
    return set().union(*map(exported_metric_names, pages))


def test_every_dashboard_and_alert_query_names_an_exported_metric(platform):
    httpx.post(platform.gateway.base_url + "/v1/completions", json={"model": "nope"})  # a rejection: 404
    echo_infer(platform.triton.url)
    live = _live_names(platform)
    assert {
        "vllm:generation_tokens_total",
        "llmserve_gateway_rejections_total",
        "nv_inference_queue_duration_us",
    } <= live

    queries = _dashboard_queries()
    assert len(queries) > 30
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "llmserve.yml").read_text())["groups"]
    recorded = {r["record"] for g in rules for r in g["rules"] if "record" in r}
    queries += [("rules", r["expr"]) for g in rules for r in g["rules"]]
    adapter = yaml.safe_load(next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "prometheus-adapter.yaml").read_text()))
                             ["data"]["config.yaml"])  # fmt: skip
    queries += [("prometheus-adapter", r["seriesQuery"]) for r in adapter["rules"]]

    unknown = {}
    for where, expr in queries:
        names = promql_metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        missing = names - live - recorded - {"up"}  # `up` is Prometheus's own series
        if missing:
            unknown[f"{where}: {expr}"] = sorted(missing)
    assert not unknown, json.dumps(unknown, indent=1)
    # the check can fail: a name nobody exports is caught
    assert promql_metric_names("rate(vllm:time_per_output_token_seconds_bucket[1m])") - live


# --- the status page ------------------------------------------------------------------------


class Load:
    """Streamed completions through the gateway from a few threads until stopped."""

    def __init__(self, base_url: str, clients: int = 3):
        self.base_url, self.stop_flag, self.errors = base_url, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                _complete(self.base_url, max_tokens=48, stream=True)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(60)


def _cell(url: str, field: str) -> str:
    return f'document.querySelector(\'#upstreams td[data-key="{url}"][data-field="{field}"]\')?.textContent'


def test_status_page_shows_live_numbers_while_load_runs(platform, tmp_path):
    url = platform.server.base_url
    browser = Browser(tool("chromium"), platform.gateway.base_url + "/dashboard", tmp_path / "profile")
    try:
        browser.wait_for("Number(document.body?.dataset.updates) > 0")
        assert browser.evaluate(_cell(url, "state")) == "up"
        with Load(platform.gateway.base_url) as load:
            readings = []
            deadline = time.monotonic() + 20
            while len(set(readings)) < 3 and time.monotonic() < deadline:
                value = browser.evaluate(_cell(url, "tokens_per_s"))
                if value not in ("–", "0.0", None):
                    readings.append(value)
                time.sleep(0.5)
            assert len(set(readings)) >= 3, f"tokens/s did not change while load ran: {readings}"
            browser.wait_for(f"Number({_cell(url, 'running')}) > 0", 10)
            assert float(browser.evaluate(_cell(url, "ttft_ms"))) > 0
            assert (
                browser.evaluate('document.querySelector(\'[data-key="chat"][data-field="replicas_up"]\').textContent')
                == "1/1"
            )
            browser.wait_for("document.querySelectorAll('#cards path').length >= 6")  # the charts drew
            shot = Path(os.environ.get("LLMSERVE_DASHBOARD_PNG", tmp_path / "dashboard.png"))
            browser.screenshot(shot)  # LLMSERVE_DASHBOARD_PNG=docs/dashboard.png keeps one for the docs
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert not load.errors, load.errors[:3]
        updates = int(browser.evaluate("document.body.dataset.updates"))
        browser.wait_for(f"{_cell(url, 'running')} === '0'", 10)  # load gone: the page follows
        # it refreshes itself (waited for: the running count may read 0 already when the load ends)
        browser.wait_for(f"Number(document.body.dataset.updates) > {updates}", 10)
    finally:
        browser.close()


# --- nginx ----------------------------------------------------------------------------------


def test_nginx_least_conn_example_proxies_a_stream(platform, tmp_path):
    """deploy/nginx/nginx.conf with its upstream lines pointed at the running server."""
    port = free_port()
    text = (DEPLOY / "nginx" / "nginx.conf").read_text()
    servers = [line for line in text.splitlines() if line.strip().startswith("server 10.")]
    assert len(servers) == 2
    upstream = platform.server.base_url.removeprefix("http://")
    text = text.replace(servers[0], f"        server {upstream} max_fails=2 fail_timeout=10s;")
    text = text.replace(servers[1] + "\n", "").replace("listen 8080;", f"listen 127.0.0.1:{port};")
    conf = tmp_path / "nginx.conf"
    conf.write_text(text.replace("worker_processes auto;", "worker_processes 1;"))
    cmd = [tool("nginx"), "-p", str(tmp_path), "-c", str(conf),
           "-g", f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log; daemon off;"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(lambda: _answers(base), 10, "nginx answers")
        lines = _complete(base, max_tokens=8, stream=True, model=MODEL).text.splitlines()
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert len(chunks) >= 2 and "".join(c["choices"][0]["text"] for c in chunks)  # streamed, not one blob
    finally:
        proc.send_signal(signal.SIGQUIT)  # graceful stop
        proc.wait(10)


def _answers(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


# --- the images' HEALTHCHECK ----------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_image_healthcheck_command_against_a_live_server(platform, dockerfile):
    """The exact HEALTHCHECK command of each image: 0 while /health answers 200, not 0 otherwise."""
    text = (DEPLOY / "docker" / dockerfile).read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("HEALTHCHECK"))
    cmd = json.loads(line[line.index("CMD") + 3 :])
    assert cmd[0] in ("python", "python3")
    cmd[0] = sys.executable  # the image's interpreter, here

    def check(url: str) -> int:
        env = {**os.environ, "LLMSERVE_HEALTH_URL": url}
        return subprocess.run(cmd, env=env, capture_output=True, timeout=30, check=False).returncode

    assert check(platform.server.base_url + "/health") == 0
    assert check(platform.gateway.base_url + "/health") == 0
    assert check(f"http://127.0.0.1:{platform.triton.http_port}/v2/health/ready") == 0
    assert check(f"http://127.0.0.1:{free_port()}/health") != 0  # nothing listening
    assert check(platform.server.base_url + "/no-such-path") != 0  # a 404 is unhealthy
