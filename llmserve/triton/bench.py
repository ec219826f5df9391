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


@dataclass
class ChatBenchResult:
    model: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    output_tokens: int
    output_tokens_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def chat_throughput(url: str, model: str = "chat", num_prompts: int = 64, max_tokens: int = 128,
                    concurrency: int = 16) -> ChatBenchResult:  # fmt: skip
    """Streamed chat (OpenAI bodies) over Triton's HTTP generate extension: `num_prompts` requests of
    `max_tokens` tokens each (ignore_eos, so every finished request made exactly that many),
    at most `concurrency` in flight."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from llmserve.openai.sse_events import split_events

    def one(i: int) -> bool:
        request = {"messages": [{"role": "user", "content": f"Question {i}: what does the json module do?"}],
                   "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
        body = {"request": json.dumps(request)}
        finish = None
        with httpx.stream("POST", f"http://{url}/v2/models/{model}/generate_stream", json=body, timeout=600) as r:
            if r.status_code != 200:
                return False
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                for event in split_events(json.loads(line[5:])["response"]):  # one or more events
                    if event.startswith("data: {"):
                        choices = json.loads(event[len("data: ") :])["choices"]
                        finish = (choices[0]["finish_reason"] if choices else None) or finish
        return finish == "length"

    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        ok = list(pool.map(one, range(num_prompts)))
    seconds = time.monotonic() - began
    done = sum(ok)
    return ChatBenchResult(
        model=model, concurrency=concurrency, requests=done, errors=num_prompts - done,
        seconds=round(seconds, 2), output_tokens=done * max_tokens,
        output_tokens_per_s=round(done * max_tokens / seconds, 1),
    )  # fmt: skip
