"""Closed-loop load on a Triton embedding model: N clients, each sending its next request
when the last one returns. A client of the server, like any other (KServe v2 over HTTP)."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class EmbedBenchResult:
    model: str
    concurrency: int
    seconds: float
    requests: int
    errors: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float

    def as_dict(self) -> dict:
        return asdict(self)


def embed_throughput(url: str, model: str = "embed", concurrency: int = 32, duration: float = 10.0,
                     texts_per_request: int = 1) -> EmbedBenchResult:  # fmt: skip
    import tritonclient.http as httpclient

    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def client_loop(i: int) -> None:
        client = httpclient.InferenceServerClient(url)
        data = np.array([[f"client {i} sentence {j}".encode()] for j in range(texts_per_request)], dtype=object)
        try:
            while time.monotonic() < stop_at:
                tensor = httpclient.InferInput("text", list(data.shape), "BYTES")
                tensor.set_data_from_numpy(data)
                start = time.monotonic()
                try:
                    client.infer(model, [tensor])
                    with lock:
                        latencies.append(time.monotonic() - start)
                except Exception:  # noqa: BLE001 - counted, the load goes on
                    with lock:
                        errors[0] += 1
        finally:
            client.close()

    began = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - began
    lat_ms = np.array(latencies or [0.0]) * 1000
    return EmbedBenchResult(
        model=model, concurrency=concurrency, seconds=round(seconds, 2), requests=len(latencies),
        errors=errors[0], requests_per_s=round(len(latencies) / seconds, 1),
        p50_ms=round(float(np.percentile(lat_ms, 50)), 1), p99_ms=round(float(np.percentile(lat_ms, 99)), 1),
    )  # fmt: skip
