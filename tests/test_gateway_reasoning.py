"""Reasoning and the Responses API through the gateway (issue 54), with the official openai client:
`llmserve serve --reasoning-parser deepseek_r1` behind a gateway with two keys. Chat replies keep
their `reasoning` (streamed and not), the keys' tokens count the thoughts, and `/v1/responses` is
served by the gateway over its chat route, its responses stored per key. The tiny model is held by
a regex to write `<think>...</think>` and an answer (as in test_responses_server)."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from gateway_utils import start_gateway
from server_utils import free_port
from test_responses_server import MESSAGES, THOUGHTS, model_dir  # noqa: F401 - model_dir: the fixture

from llmserve.gateway.config import hash_key

pytestmark = pytest.mark.integration

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
ANSWER = dict(model="tiny", input="What is 2+2?", max_output_tokens=60, temperature=0,
              extra_body={"guided_regex": THOUGHTS})  # fmt: skip


@pytest.fixture(scope="module")
def gateway(model_dir):  # noqa: F811
    from server_utils import start_server

    tmp = model_dir.parent
    replica = start_server([str(model_dir), "--max-model-len", "512", "--served-model-name", "tiny",
                            "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser",
                            "hermes"], str(tmp / "replica.log"))  # fmt: skip
    config = {"models": {"tiny": {"replicas": [replica.base_url]}},
              "keys": [{"name": name, "sha256": hash_key(key), "tpm": 100_000} for name, key in KEYS.items()],
              "responses": {"store": str(tmp / "gateway-responses.sqlite")}}  # fmt: skip
    gw = start_gateway(config, free_port(), str(tmp))
    gw.replica_url = replica.base_url
    yield gw
    gw.stop()
    replica.stop()


def client_of(gateway, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=KEYS[name], max_retries=0, timeout=60)


def tokens(gateway, key: str, kind: str) -> float:
    """The gateway's llmserve_gateway_tokens_total for `key` and `kind`."""
    page = httpx.get(f"{gateway.base_url}/metrics").text
    pattern = rf'^llmserve_gateway_tokens_total\{{alias="tiny",key="{key}",kind="{kind}"\}} (\S+)$'
    found = re.search(pattern, page, re.M)
    return float(found.group(1)) if found else 0.0


def test_chat_reasoning_passes_through(gateway):
    client = client_of(gateway, "alice")
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, extra_body={"guided_regex": THOUGHTS})
    before = tokens(gateway, "alice", "reasoning")
    done = client.chat.completions.create(**kw)
    msg, usage = done.choices[0].message, done.usage
    assert re.fullmatch(r"\nI see [a-z]{3,6}\.\n", msg.reasoning) and msg.reasoning_content == msg.reasoning
    assert re.fullmatch(r"\n\nThe answer is [0-9]\.", msg.content)
    k = usage.completion_tokens_details.reasoning_tokens
    assert 0 < k < usage.completion_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thoughts = [d.reasoning for d in deltas if getattr(d, "reasoning", None)]
    assert len(thoughts) > 1 and "".join(thoughts) == msg.reasoning
    assert [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)] == thoughts
    assert "".join(d.content for d in deltas if d.content) == msg.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == k and chunks[-1].model == "tiny"
    # the key's tokens count the thoughts (the limits settle with the total, thoughts included)
    assert tokens(gateway, "alice", "reasoning") == before + 2 * k
    assert tokens(gateway, "alice", "completion") >= 2 * usage.completion_tokens


def token_ids(client: openai.OpenAI, model: str) -> dict:
    """vLLM's `return_token_ids` asked of `client`, chat and completions, streamed and not: the
    prompt's and each answer's token ids as they came, checked against the usage, and streamed equal
    to whole (the regex and temperature 0 make the answers repeat)."""
    found = {}
    ask = dict(model=model, max_tokens=60, temperature=0,
               extra_body={"guided_regex": THOUGHTS, "return_token_ids": True})  # fmt: skip
    chat = client.chat.completions.create(messages=MESSAGES, **ask)
    found["chat"] = (chat.prompt_token_ids, chat.choices[0].token_ids)
    assert (len(chat.prompt_token_ids), len(chat.choices[0].token_ids)) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)  # fmt: skip
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **ask))
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids and all(
        getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])  # fmt: skip
    assert [t for c in chunks for choice in c.choices for t in choice.token_ids] == chat.choices[0].token_ids
    text = client.completions.create(prompt="2+2=", **{**ask, "max_tokens": 8})
    found["completions"] = (text.choices[0].prompt_token_ids, text.choices[0].token_ids)
    assert len(text.choices[0].token_ids) == text.usage.completion_tokens == 8
    assert len(text.choices[0].prompt_token_ids) == text.usage.prompt_tokens
    chunks = list(client.completions.create(prompt="2+2=", stream=True, **{**ask, "max_tokens": 8}))
    assert chunks[0].choices[0].prompt_token_ids == text.choices[0].prompt_token_ids
    assert [t for c in chunks for choice in c.choices for t in choice.token_ids] == text.choices[0].token_ids
    return found


def test_return_token_ids_pass_through(gateway):
    """The gateway passes `return_token_ids` on and the replica's token ids back, as they are."""
    direct = openai.OpenAI(base_url=f"{gateway.replica_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert token_ids(client_of(gateway, "alice"), "tiny") == token_ids(direct, "tiny")


def test_responses_through_the_gateway(gateway):
    alice, bob = client_of(gateway, "alice"), client_of(gateway, "bob")
    before = tokens(gateway, "alice", "reasoning")
    r = alice.responses.create(**ANSWER)
    assert r.status == "completed" and r.model == "tiny" and [i.type for i in r.output] == ["reasoning", "message"]
    assert re.fullmatch(r"\nI see [a-z]{3,6}\.\n", r.output[0].content[0].text)
    assert re.fullmatch(r"\n\nThe answer is [0-9]\.", r.output_text)
    thoughts = r.usage.output_tokens_details.reasoning_tokens
    assert 0 < thoughts < r.usage.output_tokens and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert tokens(gateway, "alice", "reasoning") == before + thoughts  # its chat request was alice's
    assert alice.responses.retrieve(r.id).model_dump() == r.model_dump()
    items = alice.responses.input_items.list(r.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]
    for call in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.delete(r.id),
                 lambda: bob.responses.input_items.list(r.id),
                 lambda: bob.responses.create(model="tiny", input="x", max_output_tokens=2, previous_response_id=r.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):  # another key's response does not exist for it
            call()
    # streamed: the typed events in order, the reasoning first
    with alice.responses.stream(**{**ANSWER, "previous_response_id": r.id}) as stream:
        events = list(stream)
        second = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # chained: the second turn saw the first (its input and output) before its own input
    assert second.usage.input_tokens > r.usage.input_tokens + 5
    history = alice.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in history.data] == ["message", "reasoning", "message", "message"]
    alice.responses.delete(r.id)  # (the client reads no body)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    assert alice.responses.retrieve(second.id).status == "completed"  # a chain keeps its whole history


def test_background_and_cancel(gateway):
    alice = client_of(gateway, "alice")
    r = alice.responses.create(model="tiny", input="Say many words.", max_output_tokens=200, background=True,
                               extra_body={"ignore_eos": True})  # fmt: skip
    assert r.status == "queued" and r.background
    seen = alice.responses.retrieve(r.id).status
    assert seen in ("queued", "in_progress")
    cancelled = alice.responses.cancel(r.id)
    assert cancelled.status in ("cancelled", "completed")
    deadline = time.monotonic() + 30
    while alice.responses.retrieve(r.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_bad_input_is_a_4xx(gateway):
    url, auth = f"{gateway.base_url}/v1/responses", {"authorization": f"Bearer {KEYS['alice']}"}
    cases = [
        (None, {"model": "tiny", "input": "x"}, 401, "invalid_api_key"),
        (auth, {"input": "x"}, 400, None),  # no model: the gateway cannot route it
        (auth, {"model": "nope", "input": "x"}, 404, "model_not_found"),
        (
            auth,
            {"model": "tiny", "input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
            400,
            None,
        ),
        (auth, {"model": "tiny", "input": "x", "max_output_tokens": 0}, 400, None),
        (auth, {"model": "tiny", "input": "x", "previous_response_id": "resp_unknown"}, 404, None),
        (auth, {"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, 400, None),
        (auth, {"model": "tiny", "input": "x", "background": True, "store": False}, 400, None),
        (auth, {"model": "tiny", "input": "x", "max_output_tokens": 10_000_000}, 400, None),  # over the key's tpm
    ]
    for headers, body, status, code in cases:
        got = httpx.post(url, json=body, headers=headers, timeout=30)
        assert got.status_code == status, (body, got.text)
        assert "error" in got.json(), got.text
        if code is not None:
            assert got.json()["error"]["code"] == code
    assert "input[0].content[0].type" in httpx.post(url, json=cases[3][1], headers=auth).json()["error"]["message"]
    assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
    for method, path in (("GET", "/resp_x"), ("DELETE", "/resp_x"), ("POST", "/resp_x/cancel"),
                         ("GET", "/resp_x/input_items")):  # fmt: skip
        assert httpx.request(method, url + path, headers=auth).status_code == 404
        assert httpx.request(method, url + path).status_code == 401
    assert httpx.get(url + "/resp_x/input_items?limit=0", headers=auth).status_code in (400, 404)
