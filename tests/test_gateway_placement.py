"""Placement over `llmserve serve --enable-sleep-mode` servers (the way vLLM users run several
models on one GPU): three servers of which a budget fits two, the gateway waking the one a
request needs. Real servers and a real gateway, called with the official openai client."""

from __future__ import annotations

import concurrent.futures
import os
import random
import sys
import time

import httpx
import openai
import pytest
from gateway_utils import spawn_gateway
from server_utils import free_port, spawn, wait_healthy

from llmserve.config import TINY_MODEL_DIR

pytestmark = pytest.mark.integration

NAMES = ["tiny-a", "tiny-b", "tiny-c"]


def test_placement_over_llmserve_servers(tmp_path):
    servers = {}
    for name in NAMES:
        port = free_port()
        cmd = [sys.executable, "-m", "llmserve", "serve", str(TINY_MODEL_DIR), "--port", str(port),
               "--served-model-name", name, "--max-model-len", "256", "--enable-sleep-mode",
               "--kv-cache-memory-bytes", str(16 << 20)]  # fmt: skip
        servers[name] = spawn(cmd, port, os.path.join(tmp_path, f"{name}.log"), {"LLMSERVE_ADMIN_API_KEY": "pk"})
    admin = {"Authorization": "Bearer pk"}  # the servers' admin routes need it; the gateway reads it from its env
    gateway = None
    try:
        for server in servers.values():
            wait_healthy(server, 180)
        assert httpx.get(next(iter(servers.values())).base_url + "/footprint", timeout=10).status_code == 401
        rows = {n: httpx.get(s.base_url + "/footprint", headers=admin, timeout=10).json() for n, s in servers.items()}
        assert all(
            r["is_sleeping"] is False and r["weight_bytes"] > 0 and r["kv_cache_bytes"] > 0 for r in rows.values()
        )
        size = max(r["weight_bytes"] + r["kv_cache_bytes"] for r in rows.values())
        config = {"models": {n: {"replicas": [s.base_url], "admin_api_key_env": "PLACEMENT_KEY"} for n, s in servers.items()},
                  "placement": {"gpu_memory_budget": int(size * 2.5), "models": NAMES, "prewarm_interval_s": 0.2}}  # fmt: skip
        port = free_port()
        gateway = wait_healthy(spawn_gateway(config, port, str(tmp_path), env={"PLACEMENT_KEY": "pk"}), 60)
        deadline = time.monotonic() + 30
        while not (placement := httpx.get(gateway.base_url + "/health").json()["placement"])["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for _ in range(50):  # fit() puts one to sleep
            states = [m["state"] for m in httpx.get(gateway.base_url + "/health").json()["placement"]["models"]]
            if states.count("asleep") == 1:
                break
            time.sleep(0.1)
        assert sorted(states) == ["asleep", "resident", "resident"], states
        asleep = next(m["model"] for m in httpx.get(gateway.base_url + "/health").json()["placement"]["models"]
                      if m["state"] == "asleep")  # fmt: skip
        assert httpx.get(servers[asleep].base_url + "/is_sleeping", headers=admin).json() == {"is_sleeping": True}

        client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        rng = random.Random(3)
        calls = [rng.choice(NAMES) for _ in range(24)]

        def call(model: str) -> str:
            reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                              temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
            assert reply.model == model
            return reply.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(call, calls))  # a failed request raises here
        assert len(set(texts)) == 1  # the same tiny model behind each name: the same greedy answer
        placement = httpx.get(gateway.base_url + "/health").json()["placement"]
        assert placement["device_bytes"] <= placement["budget_bytes"]
        assert sum(m["wakes"] for m in placement["models"]) >= 1 and all(
            m["in_flight"] == 0 for m in placement["models"]
        )
        for name, server in servers.items():  # each server's own account agrees, nothing leaked
            row = httpx.get(server.base_url + "/footprint", headers=admin).json()
            state = next(m["state"] for m in placement["models"] if m["model"] == name)
            assert row["is_sleeping"] == (state == "asleep") and row["num_blocks_used"] == 0
    finally:
        if gateway is not None:
            gateway.stop()
        for server in servers.values():
            server.stop()


def test_a_server_without_sleep_mode_is_not_placed_and_the_gateway_says_why(tmp_path):
    """Without --enable-sleep-mode a server has no /footprint: placement stays off with the
    reason on /health, and requests still pass through."""
    from server_utils import start_server

    server = start_server([str(TINY_MODEL_DIR), "--max-model-len", "128", "--served-model-name", "plain"],
                          os.path.join(tmp_path, "plain.log"))  # fmt: skip
    gateway = None
    try:
        assert httpx.get(server.base_url + "/footprint").status_code == 404
        config = {"models": {"plain": {"replicas": [server.base_url]}},
                  "placement": {"gpu_memory_budget": "1GiB", "models": ["plain"]}}  # fmt: skip
        gateway = wait_healthy(spawn_gateway(config, free_port(), str(tmp_path)), 60)
        deadline = time.monotonic() + 30
        while not (placement := httpx.get(gateway.base_url + "/health").json()["placement"])["error"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert not placement["running"] and "enable_sleep_mode" in placement["error"]
        body = {"model": "plain", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()
