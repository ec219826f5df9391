"""Details of the OpenAI API where llmserve differed from OpenAI and vLLM (issue 49, items 2 and
6), on a real `llmserve serve` (a tiny random model) through the official openai client and
httpx: a token-id prompt cut inside a character, `return_token_ids`, `echo` with `logprobs`,
`prompt_logprobs`, a token's own bytes, string error codes, `system_fingerprint`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_utils import start_server

from llmserve.engine.detokenizer import stable_prompt_text

pytestmark = pytest.mark.integration

API_KEY = "details-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CUT_TEXT = "The json module 😀"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("details") / "server.log"
    srv = start_server(["--model", llama_dir, "--max-model-len", "256", "--api-key", API_KEY,
                        "--served-model-name", "tiny"], str(log))  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=60)


def _token_bytes(token: str) -> bytes:
    """A completions token's bytes: "bytes:\\xNN..." or its text."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])
    return token.encode()


GREEDY = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_a_token_id_prompt_cut_inside_a_character_returns_only_what_the_output_adds(client, tokenizer):
    """Issue 49 item 2: the prompt's last tokens' text came back in `text` (twice with echo)."""
    ids = tokenizer.encode(CUT_TEXT)
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert cuts  # the emoji is several tokens here
    for n in cuts[-2:]:
        prompt = ids[:n]
        whole = client.completions.create(prompt=prompt, **GREEDY).choices[0]
        assert whole.prompt_token_ids == prompt and len(whole.token_ids) == 8
        everything = tokenizer.decode(prompt + whole.token_ids)
        stable = stable_prompt_text(tokenizer.decode(prompt))
        assert not whole.text.startswith("The")
        assert stable + whole.text == everything
        chunks = list(client.completions.create(prompt=prompt, stream=True, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks) == whole.text
        assert [t for c in chunks for t in c.choices[0].token_ids] == whole.token_ids
        echoed = client.completions.create(prompt=prompt, echo=True, **GREEDY).choices[0]
        assert echoed.text == everything
        chunks = list(client.completions.create(prompt=prompt, echo=True, stream=True, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks) == everything


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(client, tokenizer):
    """As vLLM: completions' choices carry `prompt_token_ids` and `token_ids`; chat's answer the
    prompt's and its choices theirs; a stream the prompt's in its first chunk and each chunk's own."""
    comp = client.completions.create(prompt="hello there", **GREEDY).choices[0]
    assert comp.prompt_token_ids == tokenizer.encode("hello there") and len(comp.token_ids) == 8
    assert tokenizer.decode(comp.token_ids) == comp.text
    plain = client.completions.create(model="tiny", prompt="hello there", max_tokens=2).model_dump()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert chat.prompt_token_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert tokenizer.decode(chat.choices[0].token_ids) == chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}))  # fmt: skip
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == chat.choices[0].token_ids
    bare = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).model_dump()
    assert "prompt_token_ids" not in bare and "token_ids" not in bare["choices"][0]


def test_echo_with_logprobs_gives_the_prompts_tokens_first(client, tokenizer):
    """As OpenAI and vLLM: the prompt's tokens first (the first with a null logprob), so `tokens`
    and `text_offset` cover the echoed text; the prompt's logprobs are its prompt_logprobs."""
    prompt = "The json module is"
    p = len(tokenizer.encode(prompt))
    choice = client.completions.create(prompt=prompt, echo=True, logprobs=2, **GREEDY).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) == p + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert b"".join(map(_token_bytes, lp.tokens)).decode(errors="replace") == choice.text
    assert choice.text.startswith(prompt) and lp.text_offset[p] == len(prompt)
    asked = client.completions.create(**{**GREEDY, "extra_body": {"ignore_eos": True, "prompt_logprobs": 2}},
                                      prompt=prompt).choices[0]  # fmt: skip
    by_position = [None] + [
        e[str(t)]["logprob"] for e, t in zip(asked.prompt_logprobs[1:], tokenizer.encode(prompt)[1:])
    ]
    assert lp.token_logprobs[:p] == pytest.approx(by_position, abs=1e-5)
    chunks = list(client.completions.create(prompt=prompt, echo=True, logprobs=2, stream=True, **GREEDY))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_prompt_logprobs_on_completions_and_chat(client, server, tokenizer):
    """vLLM's `prompt_logprobs`: per prompt token, the first null, {token id: {logprob, rank,
    decoded_token}} holding the prompt's token and the top k; not streamed (a 400, as vLLM)."""
    prompt = "hello there friend"
    ids = tokenizer.encode(prompt)
    body = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3}).json()
    plps = body["choices"][0]["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    for entry, token in zip(plps[1:], ids[1:]):
        assert str(token) in entry and len(entry) in (3, 4)
        assert {e["rank"] for e in entry.values() if e["rank"] <= 3} == {1, 2, 3}
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token]) and entry[str(token)]["logprob"] <= 0
    messages = [{"role": "user", "content": "hi"}]
    chat = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1}).json()
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert len(chat["prompt_logprobs"]) == len(prompt_ids) and chat["prompt_logprobs"][0] is None
    assert all(str(t) in e for e, t in zip(chat["prompt_logprobs"][1:], prompt_ids[1:]))
    for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": messages})):
        for bad in ({"prompt_logprobs": 2, "stream": True}, {"prompt_logprobs": -1}, {"prompt_logprobs": 21}):
            resp = _post(server, path, {**extra, **bad})
            assert resp.status_code == 400 and "prompt_logprobs" in resp.json()["error"]["message"], resp.text
    plain = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_logprobs_carry_each_tokens_own_bytes(client, tokenizer):
    """A token that is part of a character came back with U+FFFD's bytes: now its own (chat's
    `bytes`; completions' tokens as "bytes:\\xNN..."), so the tokens' bytes rebuild the text."""
    target = "😀 ok ☕"
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in tokenizer.encode(target))  # partial characters
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                          top_logprobs=2, extra_body={"guided_choice": [target]})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == target
    # (the end-of-sequence token that ended it has its logprob too, and its own text)
    assert bytes(b for entry in content for b in entry.bytes).decode() == target + "</s>"
    for entry in content:
        for top in entry.top_logprobs:
            assert top.bytes is not None and (top.token != entry.token or top.bytes == entry.bytes)
    comp = client.completions.create(model="tiny", prompt="x", logprobs=1, max_tokens=20,
                                     extra_body={"guided_choice": [target]}).choices[0]  # fmt: skip
    assert comp.text == target and b"".join(map(_token_bytes, comp.logprobs.tokens)).decode() == target + "</s>"
    assert any(t.startswith("bytes:") for t in comp.logprobs.tokens)
    assert comp.logprobs.text_offset[0] == 0 and comp.logprobs.text_offset[-1] == len(target)  # (the end's token)
    raw, at, starts = target.encode(), 0, []  # a token starts at the character its first byte is in
    for token in comp.logprobs.tokens[:-1]:
        starts.append(len(raw[:at].decode(errors="ignore")))
        at += len(_token_bytes(token))
    assert comp.logprobs.text_offset[:-1] == starts


def test_every_error_code_is_a_string(server):
    """`code` was the HTTP status (a number) where no code was named, a string elsewhere."""
    cases = [
        ("post", "/v1/completions", {"prompt": "x", "temperature": "hot"}),  # schema
        ("post", "/v1/completions", {"prompt": "x", "top_p": 5}),  # sampling params
        ("post", "/v1/completions", {"prompt": "x", "model": "gpt-9"}),  # unknown model
        ("post", "/v1/nothing-here", {}),  # unknown route
        ("get", "/v1/completions", None),  # wrong method
        ("post", "/v1/chat/completions", {"messages": []}),
    ]
    for method, path, body in cases:
        resp = httpx.request(method, f"{server.base_url}{path}", json=body, headers=HEADERS)
        assert resp.status_code >= 400
        error = resp.json()["error"]
        assert isinstance(error["code"], str) and error["code"], (path, resp.text)
    unauthorized = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"
    assert _post(server, "/v1/completions", {"prompt": "x", "top_p": 5}).json()["error"]["code"] == "invalid_request"


def test_system_fingerprint_on_every_answer_and_chunk(client):
    messages = [{"role": "user", "content": "hi"}]
    prints = {
        client.completions.create(model="tiny", prompt="a", max_tokens=2).system_fingerprint,
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).system_fingerprint,
    }
    prints |= {
        c.system_fingerprint for c in client.completions.create(model="tiny", prompt="a", max_tokens=2, stream=True)
    }
    prints |= {c.system_fingerprint for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True})}  # fmt: skip
    assert len(prints) == 1 and next(iter(prints)).startswith("fp_")
    assert json.dumps(sorted(prints))  # one stable string


def test_token_bytes_of_byte_level_and_sentencepiece_tokenizers(tokenizer):
    """Each tokenizer kind's pieces map back to their bytes: byte-level BPE (the tiny model's),
    and SentencePiece with byte fallback (`<0xNN>` pieces, U+2581 for a space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from llmserve.openai.token_bytes import TokenBytes, token_text

    text = "The json module 😀 ☕ ok"
    ids = tokenizer.encode(text)
    own = TokenBytes(tokenizer)
    assert b"".join(map(own, ids)).decode() == text
    assert any(token_text(own(t)).startswith("bytes:") for t in ids)
    vocab = {
        "<unk>": 0,
        **{f"<0x{b:02X}>": 1 + b for b in range(256)},
        "▁": 257,
        "o": 258,
        "k": 259,
        "ok": 260,
        "▁ok": 261,
    }
    sp = Tokenizer(models.BPE(vocab, [("o", "k"), ("▁", "ok")], unk_token="<unk>", byte_fallback=True))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")
    sp_ids = fast.encode("ok 😀", add_special_tokens=False)
    assert 261 in sp_ids and 1 + 0xF0 in sp_ids  # a word piece and byte pieces
    assert b"".join(map(TokenBytes(fast), sp_ids)) == " ok 😀".encode()
