"""The gateway's LoRA routes on real `llmserve serve --enable-lora` replicas: an adapter loaded on
demand onto the replica a request goes to (behind the admin key), later requests sent to the
replica that holds it, and loaded again when that replica dropped it."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from gateway_utils import spawn_replica, start_gateway
from server_utils import free_port, metric, wait_healthy

from llmserve.gateway.config import GatewayConfig
from llmserve.lora.synthetic import write_random_adapter
from llmserve.model.arch import read_model_arch

pytestmark = pytest.mark.integration

ADMIN = "sk-admin-lora"


@pytest.fixture(scope="module")
def setup(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway_lora")
    adapter = write_random_adapter(read_model_arch(Path(llama_dir)), tmp / "adapters" / "sql", rank=8, seed=1)
    env_before = os.environ.get("LORA_ADMIN")
    os.environ["LORA_ADMIN"] = ADMIN  # the gateway process inherits it; the key is never in the file
    lora = ["--enable-lora", "--enable-runtime-lora-updating", "--max-loras", "2", "--max-lora-rank", "8",
            "--admin-api-key", ADMIN, "--lora-roots", str(tmp / "adapters")]  # fmt: skip
    ports = [free_port(), free_port()]
    spawned = [spawn_replica(llama_dir, "tiny", p, str(tmp / f"r{i}.log"), *lora) for i, p in enumerate(ports)]
    replicas = [wait_healthy(s) for s in spawned]
    urls = [r.base_url for r in replicas]
    config = {"models": {"tiny": {"replicas": urls},
                         "sql": {"replicas": urls, "lora": "sql", "lora_path": str(adapter), "admin_api_key_env": "LORA_ADMIN"}},
              "health": {"interval_s": 0.2, "timeout_s": 1.0, "failure_threshold": 2}}  # fmt: skip
    gateway = start_gateway(config, free_port(), str(tmp))
    yield {"gateway": gateway, "replicas": replicas, "urls": urls}
    gateway.stop()
    for r in replicas:
        r.stop()
    if env_before is None:
        os.environ.pop("LORA_ADMIN", None)


def _holders(urls: list[str]) -> list[bool]:
    return [any(m["id"] == "sql" for m in httpx.get(u + "/v1/models").json()["data"]) for u in urls]


def _complete(gateway, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "SELECT", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=60)


def test_an_adapter_is_loaded_on_demand_then_its_requests_go_where_it_is(setup):
    gateway, urls = setup["gateway"], setup["urls"]
    assert _holders(urls) == [False, False]
    first = _complete(gateway, "sql")
    assert first.status_code == 200 and first.json()["model"] == "sql", first.text
    holders = _holders(urls)
    assert sorted(holders) == [False, True]  # loaded on the replica the request went to, only there
    texts = {_complete(gateway, "sql").json()["choices"][0]["text"] for _ in range(6)}
    assert texts == {first.json()["choices"][0]["text"]}  # greedy, one adapter: the same tokens
    assert _holders(urls) == holders  # sent to the holder: never loaded on the other
    assert metric(gateway.base_url, "llmserve_gateway_adapter_loads_total") == 1
    text = httpx.get(gateway.base_url + "/metrics").text
    assert 'llmserve_gateway_routing_total{alias="sql",decision="adapter_held"} 6.0' in text
    base = _complete(gateway, "tiny")
    assert base.status_code == 200 and base.json()["choices"][0]["text"] != first.json()["choices"][0]["text"]


def test_an_adapter_the_replica_dropped_is_loaded_again(setup):
    gateway, urls = setup["gateway"], setup["urls"]
    holder = urls[_holders(urls).index(True)]
    resp = httpx.post(holder + "/v1/unload_lora_adapter", json={"lora_name": "sql"},
                      headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
    assert resp.status_code == 200
    # the gateway may still think it is there (until its next health poll): either way no failure
    for _ in range(3):
        assert _complete(gateway, "sql").status_code == 200
    assert any(_holders(urls))


def test_lora_path_needs_a_lora_route_on_llmserve_replicas():
    for bad in ({"replicas": ["http://x:1"], "lora_path": "/a"},
                {"kind": "triton", "replicas": ["grpc://x:1"], "lora": "a", "lora_path": "/a"}):  # fmt: skip
        with pytest.raises(ValueError, match="lora_path"):
            GatewayConfig.model_validate({"models": {"m": bad}})
