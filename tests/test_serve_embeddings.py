"""`llmserve serve --task embed`: a real server process on 127.0.0.1 with all-MiniLM-L6-v2,
driven by the official openai client and httpx; vectors checked against
sentence-transformers run here."""

from __future__ import annotations

import asyncio
import base64
import re
import sys

import httpx
import numpy as np
import openai
import pytest
from server_utils import free_port, spawn, start_server, wait_healthy

from llmserve.openai.errors import default_code
from llmserve.pooling import default_embedding_model_dir

pytestmark = pytest.mark.integration

KEY = "embed-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("embed") / "server.log"
    srv = start_server(["--task", "embed", "--api-key", KEY, "--served-model-name", "embed",
                        "--max-batch-inputs", "16"], str(log))  # fmt: skip
    yield srv
    assert srv.stop() in (0, -15), srv.log()


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(default_embedding_model_dir(), device="cpu")


def embed_here(model, texts: list[str]) -> np.ndarray:
    return model.encode(texts, convert_to_numpy=True, normalize_embeddings=True)


TEXTS = ["hello world", "The cat sat on the mat.", "Python lists are mutable sequences."]


def test_openai_client_gets_sentence_transformers_vectors(server, reference):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    want = embed_here(reference, TEXTS)
    for fmt in ({}, {"encoding_format": "float"}):  # untold, the client asks for base64 and decodes it
        resp = client.embeddings.create(model="embed", input=TEXTS, **fmt)
        got = np.array([d.embedding for d in resp.data])
        assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == "embed"
        np.testing.assert_allclose(got, want, atol=2e-5)
    ids = reference.tokenizer(TEXTS)["input_ids"]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(x) for x in ids)
    one = client.embeddings.create(model="embed", input="hello world")
    np.testing.assert_allclose(one.data[0].embedding, want[0], atol=2e-5)
    assert [m.id for m in client.models.list().data] == ["embed"]


def test_token_id_input_embeds_exactly_those_ids(server, reference):
    """Token ids (one list, or a list of lists, as OpenAI's API takes them) are embedded as
    given: the ids the model's tokenizer makes of a text give that text's vector."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    ids = reference.tokenizer(TEXTS)["input_ids"]
    resp = client.embeddings.create(model="embed", input=ids, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in resp.data], embed_here(reference, TEXTS), atol=2e-5)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(x) for x in ids)
    one = client.embeddings.create(model="embed", input=ids[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, resp.data[1].embedding, atol=2e-5)
    assert one.usage.total_tokens == len(ids[1])


def test_base64_is_little_endian_float32(server, reference):
    body = {"input": ["hello world"], "encoding_format": "base64"}
    data = httpx.post(f"{server.base_url}/v1/embeddings", json=body, headers=AUTH).json()["data"]
    vector = np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, embed_here(reference, ["hello world"])[0], atol=2e-5)


def test_concurrent_requests_are_batched_and_each_gets_its_own_vectors(server, reference):
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'stocks'}" for i in range(40)]
    before = _batches(server.base_url)

    async def run() -> list[list[float]]:
        async with httpx.AsyncClient(timeout=60) as client:

            async def one(t: str) -> list[float]:
                r = await client.post(f"{server.base_url}/v1/embeddings", json={"input": t}, headers=AUTH)
                assert r.status_code == 200, r.text
                return r.json()["data"][0]["embedding"]

            return await asyncio.gather(*(one(t) for t in texts))

    got = np.array(asyncio.run(run()))
    np.testing.assert_allclose(got, embed_here(reference, texts), atol=2e-5)
    requests, batches = (a - b for a, b in zip(_batches(server.base_url), before))
    assert requests == 40 and batches < 40, (requests, batches)  # some batches served several


def _batches(base_url: str) -> tuple[float, float]:
    text = httpx.get(f"{base_url}/metrics").text
    total = float(re.search(r"^llmserve:pooling_batch_requests_sum\{.*\} (\S+)$", text, re.M).group(1))
    count = float(re.search(r"^llmserve:pooling_batch_requests_count\{.*\} (\S+)$", text, re.M).group(1))
    return total, count


def test_rerank_orders_documents_by_cosine_similarity(server, reference):
    docs = ["stock prices fell today", "a cat sleeps on the mat", "dogs chase cats"]
    q = "where is the cat?"
    vecs = embed_here(reference, [q, *docs])
    want = vecs[1:] @ vecs[0]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = {"model": "embed", "query": q, "documents": [docs[0], {"text": docs[1]}, docs[2]]}
        r = httpx.post(server.base_url + path, json=body, headers=AUTH).json()
        assert [x["index"] for x in r["results"]] == list(np.argsort(-want))
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], np.sort(want)[::-1], atol=2e-5)
        assert r["results"][0]["document"]["text"] == docs[int(np.argmax(want))]
    r = httpx.post(
        f"{server.base_url}/v1/rerank",
        headers=AUTH,
        json={"query": q, "documents": docs, "top_n": 1, "return_documents": False},
    ).json()
    assert len(r["results"]) == 1 and "document" not in r["results"][0] and r["usage"]["total_tokens"] > 0


LONG = "word " * 300  # more tokens than the model's 256


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/embeddings", {"input": []}, 400, "input"),
    ("/v1/embeddings", {"input": ""}, 400, "input"),
    ("/v1/embeddings", {"input": ["ok", ""]}, 400, "input"),
    ("/v1/embeddings", {"input": [-1]}, 400, "input"),  # token ids: negative, past the vocabulary, none
    ("/v1/embeddings", {"input": [[101, 102], [101, 30522]]}, 400, "input"),
    ("/v1/embeddings", {"input": [[101], []]}, 400, "input"),
    ("/v1/embeddings", {"input": [2**70]}, 400, "input"),
    ("/v1/embeddings", {"input": [[1] * 257]}, 400, "input"),
    ("/v1/embeddings", {"input": ["x"] * 2049}, 400, "input"),
    ("/v1/embeddings", {"input": ["short", LONG]}, 400, "input"),
    ("/v1/embeddings", {"input": [1.5]}, 400, None),
    ("/v1/embeddings", {"input": "hi", "dimensions": 10}, 400, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, 400, None),
    ("/v1/embeddings", {"input": "hi", "model": "nope"}, 404, "model"),
    ("/v1/embeddings", {}, 400, None),
    ("/v1/embeddings", [1, 2], 400, None),
    ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, 400, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, 400, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 400, None),
    ("/v1/rerank", {"query": LONG, "documents": ["a"]}, 400, "query"),
    ("/v1/rerank", {"query": "q"}, 400, None),
    ("/v1/embeddings", b'{"input": ["ok", "a\\ud800"]}', 400, None),  # a lone surrogate (escaped)
    ("/v1/rerank", b'{"query": "q", "documents": ["\\udfff"]}', 400, None),
])  # fmt: skip
def test_bad_input_gets_a_clear_4xx(server, path, body, status, param):
    kwargs = {"content": body, "headers": {**AUTH, "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": AUTH}  # fmt: skip
    r = httpx.post(server.base_url + path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and isinstance(error["code"], str)  # codes are strings, as OpenAI's
    assert error["code"] in (default_code(status), "model_not_found", "invalid_json"), error
    if param:
        assert error["param"] == param
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_not_json_and_missing_key(server):
    r = httpx.post(f"{server.base_url}/v1/embeddings", content=b"{not json", headers=AUTH)
    assert r.status_code == 400
    r = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).embeddings.create(
            model="embed", input="hi"
        )


def test_bad_model_folder_fails_fast(tmp_path):
    port = free_port()
    srv = spawn([sys.executable, "-m", "llmserve", "serve", "--task", "embed", str(tmp_path / "missing"),
                 "--port", str(port)], port, str(tmp_path / "log"))  # fmt: skip
    with pytest.raises(RuntimeError, match="does not exist"):
        wait_healthy(srv, timeout=60)
    assert srv.proc.wait(10) != 0


def test_behind_the_gateway(tmp_path, reference):
    """The gateway routes /v1/embeddings and /v1/rerank to an embedding server like any
    OpenAI upstream, under its own keys."""
    from gateway_utils import start_gateway

    from llmserve.gateway.config import hash_key

    upstream = start_server(["--task", "embed"], str(tmp_path / "embed.log"))
    config = {
        "models": {"vectors": {"replicas": [upstream.base_url], "model": "all-MiniLM-L6-v2"}},
        "keys": [{"name": "team", "sha256": hash_key("sk-team")}],
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2},
    }
    gateway = start_gateway(config, free_port(), str(tmp_path))
    try:
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="sk-team", max_retries=0)
        resp = client.embeddings.create(model="vectors", input=TEXTS)
        np.testing.assert_allclose([d.embedding for d in resp.data], embed_here(reference, TEXTS), atol=2e-5)
        r = httpx.post(f"{gateway.base_url}/v1/rerank", headers={"Authorization": "Bearer sk-team"},
                       json={"model": "vectors", "query": "a cat", "documents": ["stocks", "a kitten"]})  # fmt: skip
        assert r.status_code == 200 and r.json()["results"][0]["index"] == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="sk-nope", max_retries=0).embeddings.create(
                model="vectors", input="hi"
            )
    finally:
        gateway.stop()
        upstream.stop()
