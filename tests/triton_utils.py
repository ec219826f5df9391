"""Helpers for tests on the real Triton server: ports, clients, metrics."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def text_input(module, name: str, texts: list[str], shape: list[int] | None = None):
    data = np.array([t.encode() for t in texts], dtype=np.object_)
    data = data.reshape(shape or [len(texts), 1])
    tensor = module.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return tensor


def embed(url: str, texts: list[str], module=httpclient, version: str = "") -> np.ndarray:
    client = module.InferenceServerClient(url)
    try:
        result = client.infer("embed", [text_input(module, "text", texts)], model_version=version)
        return result.as_numpy("embedding")
    finally:
        client.close()


def rerank(url: str, query: str, docs: list[str], module=httpclient) -> np.ndarray:
    client = module.InferenceServerClient(url)
    try:
        inputs = [text_input(module, "query", [query], [1, 1]),
                  text_input(module, "documents", docs, [1, len(docs)])]  # fmt: skip
        return client.infer("rerank", inputs).as_numpy("scores")[0]
    finally:
        client.close()


def metric(metrics_url: str, name: str, model: str) -> float:
    """Sum of one Prometheus counter over a model's versions."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    pattern = re.compile(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} ([0-9.e+]+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


# a Triton model that costs nothing to load: its per-model nv_inference_* series are real
ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 1 ] } ]
dynamic_batching { }
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""
ECHO_MODEL = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
                for r in requests]
"""


def echo_repo(root: Path) -> Path:
    """A model repository holding the echo model."""
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    return root


def echo_infer(url: str) -> None:
    """One call of the echo model over HTTP, checked."""
    client = httpclient.InferenceServerClient(url)
    try:  # closed at once: an open connection would hold Triton's shutdown for its exit timeout
        x = httpclient.InferInput("x", [2, 1], "FP32")
        x.set_data_from_numpy(np.ones((2, 1), np.float32))
        assert client.infer("echo", [x]).as_numpy("y").tolist() == [[1.0], [1.0]]
    finally:
        client.close()


__all__ = ["echo_infer", "echo_repo", "embed", "grpcclient", "httpclient", "metric", "rerank", "text_input"]
