"""Helpers for tests on the real Triton server: ports, clients, metrics."""

from __future__ import annotations

import re
import urllib.request

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


__all__ = ["embed", "grpcclient", "httpclient", "metric", "rerank", "text_input"]
