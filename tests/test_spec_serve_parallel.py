"""Speculative decoding served under tensor and pipeline parallelism: real `llmserve serve` processes
(CPU, gloo) at TP=2 and at PP=2 with n-gram proposals, and at TP=2 with an EAGLE-3 head, give through
the official openai client (completions and chat, streamed and not) the greedy text of a served TP=1
engine without speculation; /metrics shows vLLM's spec-decode counters growing; a stream the client
closes mid-way under TP=2 leaves the server healthy. (In-process equality of tokens, proposals and
counters: tests/test_spec_tensor_parallel.py.)"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_utils import metric, start_server
from test_spec_eagle import target_with_heads

pytestmark = pytest.mark.integration

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 3}  # test_spec_eagle's random head
COMMON = ["--max-model-len", "128", "--served-model-name", "tiny"]
# repeats for the n-gram proposer to find (tests/test_spec_tensor_parallel.py's prompts)
PROMPTS = [[1, 5, 9, 30, 44, 7, 8, 100, 101, 5, 9, 30], [1, 7, 7, 7, 7, 7, 7, 7]]
CHAT = "Return the value. Return the value. Return the value."
MAX_TOKENS = 16
DRAFTS, ACCEPTED = "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """name -> a running server, started once for the module."""
    root = tmp_path_factory.mktemp("spec_serve")
    target, heads = target_with_heads(root)
    configs = {
        "plain": [],
        "tp2-ngram": ["--tensor-parallel-size", "2", "--speculative-config", json.dumps(NGRAM)],
        "pp2-ngram": ["--pipeline-parallel-size", "2", "--speculative-config", json.dumps(NGRAM)],
        "tp2-eagle3": ["--tensor-parallel-size", "2",
                       "--speculative-config", json.dumps(EAGLE3 | {"model": heads["eagle3"]})],
    }  # fmt: skip
    # all at once (their starts overlap), with time for a busy machine
    with ThreadPoolExecutor(len(configs)) as pool:
        starts = {name: pool.submit(start_server, ["--model", target, *COMMON, *args], str(root / f"{name}.log"), 240)
                  for name, args in configs.items()}  # fmt: skip
    try:
        yield {name: start.result() for name, start in starts.items()}
    finally:
        for start in starts.values():
            if start.exception() is None:
                start.result().stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def _answers(server) -> list[tuple[str, str]]:
    """(text, finish reason) of greedy completions and chats, streamed and not."""
    client = _client(server)
    greedy = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    out = []
    for prompt in PROMPTS:
        c = client.completions.create(prompt=prompt, **greedy)
        out.append((c.choices[0].text, c.choices[0].finish_reason))
        chunks = list(client.completions.create(prompt=prompt, stream=True, **greedy))
        out.append(("".join(ch.choices[0].text for ch in chunks if ch.choices),
                    [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]))  # fmt: skip
    messages = [{"role": "user", "content": CHAT}]
    c = client.chat.completions.create(messages=messages, **greedy)
    out.append((c.choices[0].message.content, c.choices[0].finish_reason))
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **greedy))
    out.append(("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
                [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def plain(served):
    """The served TP=1 engine's answers without speculation."""
    answers = _answers(served["plain"])
    assert all(reason == "length" and text for text, reason in answers)
    return answers


@pytest.mark.parametrize("name", ["tp2-ngram", "pp2-ngram", "tp2-eagle3"])
def test_served_speculation_equals_plain_tp1(served, plain, name):
    """The greedy text of TP=1 without speculation; the draft token counter grows, and the accepted
    one (n-gram: it grows; the random EAGLE-3 head rarely agrees with its target)."""
    server = served[name]
    before = metric(server.base_url, DRAFTS), metric(server.base_url, ACCEPTED)
    assert _answers(server) == plain
    drafts, accepted = metric(server.base_url, DRAFTS), metric(server.base_url, ACCEPTED)
    assert drafts > before[0]
    assert (0 if name.endswith("eagle3") else 1) <= accepted - before[1] <= drafts - before[0]
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}'
        in httpx.get(f"{server.base_url}/metrics").text
    )


def test_tp2_stream_closed_mid_way_leaves_server_healthy(served, plain):
    """A speculating stream the client closes after two chunks is cut short: it stops generating, holds
    no KV block and runs no more; the next requests answer as before."""
    server = served["tp2-ngram"]
    generated = metric(server.base_url, "vllm:generation_tokens_total")
    stream = _client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=110, temperature=0.0,
                                                stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for _, _ in zip(stream, range(2)):
        pass
    stream.close()
    deadline = time.monotonic() + 20
    while metric(server.base_url, "vllm:num_requests_running") or metric(server.base_url, "vllm:num_kv_blocks_used"):
        assert time.monotonic() < deadline, "the closed stream's request still runs"
        time.sleep(0.1)
    assert metric(server.base_url, "vllm:generation_tokens_total") - generated < 110
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert _answers(server) == plain
