"""`llmserve up` with four chat models under a memory budget that fits two (issue 21): the
gateway wakes a sleeping model for its requests, putting an idle one to sleep first. Started
for real (Triton, four engines, the gateway), called with the official openai client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import subprocess
import sys
import time

import httpx
import openai
import pytest
import yaml
from gateway_utils import start_gateway
from server_utils import free_port
from up_utils import running_up

from llmserve.config import TINY_MODEL_DIR

pytestmark = pytest.mark.integration

MODELS = ["chat-a", "chat-b", "chat-c", "chat-d"]
KV_BYTES = 24 << 20  # each model's KV cache; with the tiny model's weights (~21 MiB) about 45 MiB a model
BUDGET = 100 << 20  # two models fit, three do not
PROMPTS = ["The capital of France is", "def reverse(s):", "Once upon a time", "1, 2, 3, 4,"]


def _platform_yaml(path, wake_timeout_s: float = 120.0) -> None:
    spec = {
        "models": {name: {"kind": "chat", "model_dir": str(TINY_MODEL_DIR), "max_model_len": 256,
                          "kv_cache_memory_bytes": KV_BYTES, "max_num_seqs": 8} for name in MODELS},
        "gpu_memory_budget": f"{BUDGET} B",
        "placement": {"policy": "demand", "wake_timeout_s": wake_timeout_s, "prewarm_interval_s": 0.5},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(spec))


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("up-placement")
    _platform_yaml(workdir / "platform.yaml")
    placing = lambda health: health.get("placement", {}).get("running")  # noqa: E731
    with running_up(workdir, placing, "--config", str(workdir / "platform.yaml"), timeout=400) as running:
        yield running


def _placement(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()["placement"]


def _states(url: str) -> dict[str, str]:
    return {m["model"]: m["state"] for m in _placement(url)["models"]}


def _footprints(grpc_port: int) -> dict[str, dict]:
    """Each engine's own account (its KV block counts), asked over Triton with the control call."""
    from llmserve.gateway.placement import TritonActuator
    from llmserve.gateway.triton_upstream import TritonClients

    async def ask() -> dict[str, dict]:
        clients = TritonClients()
        actuator = TritonActuator(clients, {m: (f"grpc://127.0.0.1:{grpc_port}", m) for m in MODELS})
        try:
            return {m: await actuator.footprint(m) for m in MODELS}
        finally:
            await clients.close()

    return asyncio.run(ask())


def test_two_of_four_resident_at_start_within_the_budget(up):
    placement = _placement(up["url"])
    assert placement["budget_bytes"] == BUDGET and placement["policy"] == "demand"
    states = _states(up["url"])
    assert sorted(states.values()) == ["asleep", "asleep", "resident", "resident"], states
    assert placement["device_bytes"] <= BUDGET
    sizes = [m["bytes"] for m in placement["models"]]
    assert 2 * max(sizes) <= BUDGET < 3 * min(sizes), sizes  # the test's premise: two fit, three do not
    rows = _footprints(up["ports"]["grpc"])
    assert sum(r["is_sleeping"] for r in rows.values()) == 2
    for name, row in rows.items():  # an engine asleep holds nothing on the device
        assert (row["device_bytes"] == 0) == row["is_sleeping"], (name, row)


def test_an_asleep_model_whose_backend_died_is_restarted_and_put_to_sleep_again(up):
    """The watchdog restarts a placed model awake; placement, which holds it asleep, puts it to
    sleep again, so the device holds what placement counts; a request then wakes it as usual."""
    import os
    import signal

    name = next(m for m, state in _states(up["url"]).items() if state == "asleep")
    stub = subprocess.run(["pgrep", "-f", f"{up['workdir']}/model_repository/{name}/1/model.py"],
                          capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
    os.kill(int(stub[0]), signal.SIGKILL)
    deadline = time.monotonic() + 120
    log = up["workdir"] / "up.log"
    while f"placement: {name} restarted awake while placed asleep" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while not (row := _footprints(up["ports"]["grpc"])[name])["is_sleeping"]:
        assert time.monotonic() < deadline, row
        time.sleep(0.2)
    assert row["device_bytes"] == 0 and _states(up["url"])[name] == "asleep"
    client = openai.OpenAI(base_url=up["url"] + "/v1", api_key="unused", max_retries=0, timeout=180)
    reply = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert reply.choices[0].text


def test_mixed_traffic_over_four_models_no_failure_same_answers_no_leak(up):
    client = openai.OpenAI(base_url=up["url"] + "/v1", api_key="unused", max_retries=0, timeout=180)
    rng = random.Random(0)
    calls = [(rng.choice(MODELS), rng.choice(PROMPTS), rng.random() < 0.5) for _ in range(48)]

    def call(model: str, prompt: str, stream: bool) -> str:
        if stream:
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})  # fmt: skip
            return "".join(c.choices[0].text for c in chunks)
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert reply.model == model
        return reply.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda c: call(*c), calls))  # any failed request raises here
    # the four models share the tiny model's weights: greedy answers are the same whichever
    # model answered and however often it slept and woke in between
    by_prompt: dict[str, set[str]] = {}
    for (_, prompt, _), text in zip(calls, texts):
        by_prompt.setdefault(prompt, set()).add(text)
    assert all(len(answers) == 1 and next(iter(answers)) for answers in by_prompt.values()), by_prompt

    placement = _placement(up["url"])
    models = {m["model"]: m for m in placement["models"]}
    assert sum(m["wakes"] for m in models.values()) >= 2 and sum(m["sleeps"] for m in models.values()) >= 2
    assert all(m["in_flight"] == 0 for m in models.values())
    assert placement["device_bytes"] <= BUDGET
    # nothing leaked: every engine's KV blocks are free again (asleep or not)
    rows = _footprints(up["ports"]["grpc"])
    assert all(r["num_blocks_used"] == 0 for r in rows.values()), rows
    for _ in range(50):  # /metrics and /dashboard read between two equal reads of /health's states
        states = _states(up["url"])  # (a pre-warm may move a model while they are read)
        metrics = httpx.get(up["url"] + "/metrics", timeout=5).text
        dashboard = httpx.get(up["url"] + "/dashboard/data", timeout=5).json()
        if _states(up["url"]) == states:
            break
        time.sleep(0.2)
    assert "llmserve_model_wakes_total{model=" in metrics and "llmserve_model_sleep_seconds_bucket" in metrics
    assert f"llmserve_placement_budget_bytes {float(BUDGET)}" in metrics or \
        f"llmserve_placement_budget_bytes {BUDGET:.6e}" in metrics  # fmt: skip
    resident = [line for line in metrics.splitlines() if line.startswith('llmserve_model_state{') and
                'state="resident"' in line and line.endswith(" 1.0")]  # fmt: skip
    assert len(resident) == sum(state == "resident" for state in states.values()) >= 1
    assert {m["alias"]: m["placement"] for m in dashboard["models"]} == states
    assert dashboard["placement"]["budget_bytes"] == BUDGET


def test_a_sleeping_model_is_woken_for_one_request_and_an_idle_one_sleeps(up):
    client = openai.OpenAI(base_url=up["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    states = _states(up["url"])
    target = next(n for n, s in states.items() if s == "asleep")
    reply = client.chat.completions.create(model=target, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    after = _states(up["url"])
    assert after[target] == "resident" and list(after.values()).count("resident") == 2, after


def test_a_wake_that_takes_longer_than_the_wait_is_a_503_with_retry_after(up, tmp_path):
    """A second gateway over the same Triton with a 1 ms wait: a request for the model asleep
    is refused with 503 model_waking and a Retry-After (the wake goes on; a retry is served)."""
    placement = _placement(up["url"])
    grpc = f"grpc://127.0.0.1:{up['ports']['grpc']}"
    resident = next(m for m in placement["models"] if m["state"] == "resident")["model"]
    asleep = next(m for m in placement["models"] if m["state"] == "asleep")["model"]
    config = {"models": {n: {"kind": "triton", "replicas": [grpc]} for n in (resident, asleep)},
              "placement": {"gpu_memory_budget": max(m["bytes"] for m in placement["models"]),
                            "models": [resident, asleep], "wake_timeout_s": 0.001}}  # fmt: skip
    port = free_port()
    gateway = start_gateway(config, port, str(tmp_path))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not httpx.get(url + "/health", timeout=5).json()["placement"]["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for _ in range(3):  # `llmserve up`'s own gateway may pre-warm a model between our read and the request
            asleep = next((m for m, state in _states(url).items() if state == "asleep"), asleep)
            body = {"model": asleep, "prompt": "hello", "max_tokens": 2}
            refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
            if refused.status_code == 503:
                break
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "model_waking" and float(refused.headers["retry-after"]) >= 1
        deadline, refusals = time.monotonic() + 60, 1
        while True:  # the wake went on without the request: a retry is served
            retry = httpx.post(url + "/v1/completions", json=body, timeout=60)
            if retry.status_code == 200 or time.monotonic() > deadline:
                break
            assert retry.status_code == 503, retry.text
            refusals += 1
            time.sleep(0.2)
        assert retry.status_code == 200, retry.text
        assert (
            f'llmserve_model_wake_timeouts_total{{model="{asleep}"}} {float(refusals)}'
            in httpx.get(url + "/metrics").text
        )
    finally:
        gateway.stop()


def test_bad_placement_settings_fail_at_start(tmp_path):
    spec = {"models": {"chat": {"kind": "chat"}, "embed": {"kind": "embed"}}, "gpu_memory_budget": "lots"}
    cases = [
        (spec, "gpu_memory_budget"),
        ({**spec, "gpu_memory_budget": 0.5, "placement": {"models": ["embed"]}}, "chat models"),
        ({**spec, "gpu_memory_budget": 0.5, "placement": {"policy": "random"}}, "policy"),
        ({"models": spec["models"], "placement": {"policy": "lru"}}, "needs a gpu_memory_budget"),
        ({**spec, "gpu_memory_budget": 1.5}, "fraction"),
    ]

    def start(i: int, case: dict) -> subprocess.CompletedProcess:
        path = tmp_path / f"p{i}.yaml"
        path.write_text(yaml.safe_dump(case))
        return subprocess.run([sys.executable, "-m", "llmserve", "up", "--config", str(path), "--port", str(free_port())],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # each process mostly imports: side by side
        done_all = list(pool.map(start, range(len(cases)), [case for case, _ in cases]))
    for (case, words), done in zip(cases, done_all):
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, (case, done.stderr)
