"""Property-based clients against the servers' own OpenAPI schemas (schemathesis): every
operation, with generated valid and invalid bodies, never answers a 5xx. A short run here; the
longer documented run is in docs/reliability.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gateway_utils import start_gateway
from server_utils import free_port, start_server

pytestmark = pytest.mark.integration

SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")


def fuzz(base_url: str, tmp_path: Path, max_examples: int, *extra: str) -> str:
    """Run schemathesis on `base_url`'s /openapi.json: the not_a_server_error check, a fixed seed;
    its output (the test fails with it on any 5xx)."""
    cmd = [SCHEMATHESIS, "run", f"{base_url}/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", str(max_examples), "--seed", "7", "--request-timeout", "60", "--workers", "1",
           "--phases", "examples,coverage,fuzzing", "--no-color", *extra]  # fmt: skip
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    found = re.search(r"(\d+) generated, (\d+) passed", out)
    assert found and int(found[1]) == int(found[2]) >= 100, out[-3000:]  # a real run, every case passed
    schema = httpx.get(f"{base_url}/openapi.json").json()
    operations = sum(len(methods) for methods in schema["paths"].values())
    assert re.search(rf"Tested: {operations}\b", out), out[-3000:]  # every operation of the schema
    return out


@pytest.fixture(scope="module")
def serve(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("schemathesis") / "serve.log"
    server = start_server(["--model", llama_dir, "--max-model-len", "128", "--max-num-seqs", "8",
                           "--served-model-name", "tiny", "--admin-api-key", "sk-admin"], str(log))  # fmt: skip
    yield server
    server.stop()


def test_serve_answers_no_generated_request_with_a_server_error(serve, tmp_path):
    fuzz(serve.base_url, tmp_path, 8)
    paths = httpx.get(serve.base_url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(paths)


def test_the_gateway_answers_no_generated_request_with_a_server_error(serve, tmp_path):
    config = {"models": {"tiny": {"replicas": [serve.base_url]}}}
    gateway = start_gateway(config, free_port(), str(tmp_path))
    try:
        fuzz(gateway.base_url, tmp_path, 8)
    finally:
        gateway.stop()
