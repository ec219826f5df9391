"""Reasoning through `llmserve serve --reasoning-parser deepseek_r1` and the official openai
client, and through the offline `LLM.chat`. The tiny model does not think by itself: a regex that
spells out `<think>...</think>` and the answer holds it to the format (its tokenizer writes each
marker as six tokens, so the stream splits every marker across chunks); the parser must then
cut what the model really wrote. Without such a regex its thoughts never close (max_tokens)."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest
from server_utils import start_server

from llmserve.config import TINY_MODEL_DIR

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
THOUGHTS = r"<think>\nI see [a-z]{3,6}\.\n</think>\n\nThe answer is [0-9]\."
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}  # fmt: skip
HARMONY = (
    r"<\|channel\|>analysis<\|message\|>I see [a-z]{3,6}\.<\|end\|>"
    r"<\|start\|>assistant<\|channel\|>final<\|message\|>The answer is [0-9]\."
)
CALL = r'<think>\nI will call it\.\n</think>\n\n<tool_call>\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    model = root / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>{%- endif %}" + config["chat_template"]
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    srv = start_server([str(model), "--max-model-len", "512", "--served-model-name", "tiny", "--reasoning-parser",
                        "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                       str(root / "server.log"))  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def streamed(client, **kw):
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = [d.reasoning for d in deltas if getattr(d, "reasoning", None)]
    assert reasoning == [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    content = [d.content for d in deltas if d.content]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    return reasoning, content, calls, chunks[-1].choices[0].finish_reason


def test_thoughts_apart_from_the_answer(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0, extra_body={"guided_regex": THOUGHTS})
    done = client.chat.completions.create(**kw)
    msg = done.choices[0].message
    assert re.fullmatch(r"\nI see [a-z]{3,6}\.\n", msg.reasoning) and msg.reasoning_content == msg.reasoning
    assert re.fullmatch(r"\n\nThe answer is [0-9]\.", msg.content) and done.choices[0].finish_reason == "stop"
    reasoning, content, calls, finish = streamed(client, **kw)
    assert len(reasoning) > 1 and "".join(reasoning) == msg.reasoning  # the thoughts streamed, markers cut out
    assert len(content) > 1 and "".join(content) == msg.content and not calls and finish == "stop"
    raw = httpx.post(f"{client.base_url}chat/completions", json={"messages": MESSAGES, "max_tokens": 120,
                     "temperature": 0, "guided_regex": THOUGHTS}).json()["choices"][0]["message"]  # fmt: skip
    assert raw["reasoning"] == raw["reasoning_content"] == msg.reasoning and raw["content"] == msg.content


def test_thoughts_cut_short(client):
    """max_tokens reached inside the thoughts: all of it is reasoning, no content (as vLLM's R1)."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
              extra_body={"guided_regex": r"<think>[a-z ]{40}</think>x"})  # fmt: skip
    done = client.chat.completions.create(**kw)
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "length" and msg.content is None and msg.reasoning
    assert re.fullmatch(r"[a-z ]+", msg.reasoning) and done.usage.completion_tokens == 8
    reasoning, content, _, finish = streamed(client, **kw)
    assert "".join(reasoning) == msg.reasoning and not content and finish == "length"


def test_the_constraint_leaves_the_thoughts_alone(client):
    """A JSON schema holds the answer, not the thoughts: cut short before `</think>`, the
    constrained thoughts are what the model writes unconstrained."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    free = client.chat.completions.create(**kw).choices[0].message
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    held = client.chat.completions.create(
        **kw, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    ).choices[0]
    assert held.finish_reason == "length" and held.message.content is None
    # the same thoughts (the free output may end where the held one, owing `</think>` and JSON, goes on)
    assert free.reasoning and not free.reasoning.startswith("{") and held.message.reasoning.startswith(free.reasoning)
    shown = client.chat.completions.create(**kw, tools=[TIME], tool_choice="none").choices[0].message  # the same prompt
    named = client.chat.completions.create(
        **kw, tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert named.choices[0].message.reasoning.startswith(shown.reasoning) and not named.choices[0].message.tool_calls


def test_tool_calls_after_the_thoughts(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=[TIME], max_tokens=150, temperature=0,
              extra_body={"guided_regex": CALL})  # fmt: skip
    done = client.chat.completions.create(**kw)
    msg = done.choices[0].message
    assert msg.reasoning == "\nI will call it.\n" and not (msg.content or "").strip()
    assert done.choices[0].finish_reason == "tool_calls" and [c.function.name for c in msg.tool_calls] == ["get_time"]
    reasoning, content, calls, finish = streamed(client, **kw)
    assert "".join(reasoning) == msg.reasoning and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_time", msg.tool_calls[0].function.arguments)
    ]


def test_bad_constraint_is_a_400(server):
    for stream in (False, True):
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 5, "stream": stream, "guided_grammar": "root ::= nope"})  # fmt: skip
        assert r.status_code == 400 and "invalid structured output" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_offline_chat_returns_the_parts():
    from llmserve import LLM, SamplingParams
    from llmserve.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="unknown reasoning parser"):
        LLM(str(TINY_MODEL_DIR), reasoning_parser="nope")
    llm = LLM(str(TINY_MODEL_DIR), reasoning_parser="deepseek_r1", max_model_len=256)
    try:
        params = SamplingParams(
            max_tokens=120, temperature=0, structured_outputs=StructuredOutputsParams(regex=THOUGHTS)
        )
        out = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
        assert re.fullmatch(r"\nI see [a-z]{3,6}\.\n", out.reasoning)
        assert re.fullmatch(r"\n\nThe answer is [0-9]\.", out.content) and out.text.startswith("<think>")
        plain = llm.chat(
            MESSAGES, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False, reasoning_parser="qwen3"
        )
        assert plain[0].outputs[0].reasoning is None and plain[0].outputs[0].content == plain[0].outputs[0].text
        # gpt-oss's harmony messages (here plain text in the tiny vocabulary, held to the format by a regex)
        harmony = SamplingParams(
            max_tokens=160, temperature=0, structured_outputs=StructuredOutputsParams(regex=HARMONY)
        )
        out = llm.chat(MESSAGES, harmony, use_tqdm=False, reasoning_parser="gpt_oss")[0].outputs[0]
        assert re.fullmatch(r"I see [a-z]{3,6}\.", out.reasoning) and re.fullmatch(
            r"The answer is [0-9]\.", out.content
        )
        with pytest.raises(ValueError, match="gpt_oss"):  # a constraint on the answer alone: not yet
            json_only = StructuredOutputsParams(json={"type": "object"})
            llm.chat(MESSAGES, SamplingParams(max_tokens=5, structured_outputs=json_only), reasoning_parser="gpt_oss")
    finally:
        llm.shutdown()
