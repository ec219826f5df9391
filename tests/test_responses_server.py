"""The Responses API (`/v1/responses`) and reasoning usage through `llmserve serve --reasoning-parser
deepseek_r1` and the official openai client. The tiny model does not think by itself: a regex that
spells out `<think>...</think>` and the answer holds it to the format (as in test_reasoning_server)."""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import openai
import pytest
from server_utils import metric, start_server

from llmserve.config import TINY_MODEL_DIR

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
THOUGHTS = r"<think>\nI see [a-z]{3,6}\.\n</think>\n\nThe answer is [0-9]\."
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}  # fmt: skip
CALL = r'<think>\nI will call it\.\n</think>\n\n<tool_call>\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}</tool_call>'
KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model, its chat template showing the tools and closing the thoughts in the prompt with
    `enable_thinking: false` (as Qwen3's)."""
    model = tmp_path_factory.mktemp("responses") / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>{%- endif %}"
        + config["chat_template"]
        + "{%- if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{%- endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def serve(model_dir, log: str):
    return start_server([str(model_dir), "--max-model-len", "512", "--served-model-name", "tiny", "--reasoning-parser",
                         "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--api-key", KEYS[0], "--api-key", KEYS[1],
                         "--responses-store", str(model_dir.parent / "store.sqlite")], str(model_dir.parent / log))  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir):
    servers = [serve(model_dir, "server.log")]
    yield servers  # (the last test restarts it)
    servers[-1].stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0].base_url}/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def other(server):
    """A client with the server's other key."""
    return openai.OpenAI(base_url=f"{server[0].base_url}/v1", api_key=KEYS[1], max_retries=0)


@pytest.fixture(scope="module")
def base_url(server):
    return server[0].base_url


def detokenize(client, ids: list[int]) -> str:
    return client.post("/../detokenize", body={"tokens": ids}, cast_to=object)["prompt"]


def test_chat_usage_counts_reasoning_tokens(client):
    """The thoughts' tokens: those up to the one that completes `</think>`, streamed or not."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
              extra_body={"guided_regex": THOUGHTS, "return_token_ids": True})  # fmt: skip
    done = client.chat.completions.create(**kw)
    ids, usage = done.choices[0].token_ids, done.usage
    k = usage.completion_tokens_details.reasoning_tokens
    assert 0 < k < usage.completion_tokens == len(ids)
    assert "</think>" in detokenize(client, ids[:k]) and "</think>" not in detokenize(client, ids[: k - 1])
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == k
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    cut = client.chat.completions.create(**{**kw, "max_tokens": 8})  # never closed: every token is a thought
    assert cut.usage.completion_tokens_details.reasoning_tokens == 8 == cut.usage.completion_tokens


ANSWER = dict(model="tiny", input="What is 2+2?", max_output_tokens=60, temperature=0,
              extra_body={"guided_regex": THOUGHTS})  # fmt: skip


def test_create_and_retrieve(client, other):
    r = client.responses.create(**ANSWER)
    assert r.object == "response" and r.status == "completed" and r.model == "tiny" and r.store
    assert [item.type for item in r.output] == ["reasoning", "message"]
    thought, message = r.output
    assert (
        re.fullmatch(r"\nI see [a-z]{3,6}\.\n", thought.content[0].text) and thought.content[0].type == "reasoning_text"
    )
    assert re.fullmatch(r"\n\nThe answer is [0-9]\.", r.output_text) and message.content[0].type == "output_text"
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                          extra_body={"guided_regex": THOUGHTS})  # fmt: skip
    assert chat.choices[0].message.content == r.output_text  # the same request underneath
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    with pytest.raises(openai.NotFoundError):  # another key's response does not exist for it
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="tiny", input="x", max_output_tokens=2, previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    unstored = client.responses.create(**{**ANSWER, "store": False})
    assert unstored.output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    cut = client.responses.create(**{**ANSWER, "max_output_tokens": 8})  # never closed: all thoughts
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in cut.output] == ["reasoning"] and cut.usage.output_tokens_details.reasoning_tokens == 8


def test_stream_events_in_order(client):
    with client.responses.stream(**ANSWER) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1] or not k.endswith(".delta")]
    assert compact == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    thoughts = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert kinds.count("response.reasoning_text.delta") > 1 and kinds.count("response.output_text.delta") > 1
    assert thoughts == final.output[0].content[0].text and text == final.output_text
    assert re.fullmatch(r"\n\nThe answer is [0-9]\.", text) and final.status == "completed"
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == text and stored.usage.output_tokens == final.usage.output_tokens


def test_function_calls_and_their_outputs(client):
    kw = dict(model="tiny", input="What time is it in Paris?", tools=[TIME], max_output_tokens=150, temperature=0,
              extra_body={"guided_regex": CALL})  # fmt: skip
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "function_call"] and r.status == "completed"
    call = r.output[1]
    assert call.name == "get_time" and re.fullmatch(r'\{"zone": "[A-Z]{3}"\}', call.arguments) and call.call_id
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    args = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert [e.type for e in args] == ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
    assert args[1].arguments == call.arguments and kinds[-2:] == ["response.output_item.done", "response.completed"]
    # the tool's result goes back as an item; the conversation is rebuilt from the store
    follow = client.responses.create(
        model="tiny", previous_response_id=r.id, max_output_tokens=4, temperature=0, tools=[TIME],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    prompt = client.post("/../detokenize", body={"tokens": follow.model_extra["prompt_token_ids"]}, cast_to=object)
    assert "12:00" in prompt["prompt"] and "get_time" in prompt["prompt"]  # (the tiny template shows no calls)
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items] == ["message", "reasoning", "function_call", "function_call_output"]


def test_three_chained_turns_are_the_whole_history(client):
    """Three responses chained by previous_response_id: the third's prompt is the token for token
    the one of the whole conversation sent by hand (as items, and as chat messages)."""
    turns = ["What is 2+2?", "And 3+3?", "And 4+4?"]
    kw = dict(model="tiny", max_output_tokens=60, temperature=0, instructions="Be brief.",
              extra_body={"guided_regex": THOUGHTS, "return_token_ids": True})  # fmt: skip
    previous, responses = None, []
    for turn in turns:
        r = client.responses.create(**kw, input=turn, previous_response_id=previous)
        responses.append(r)
        previous = r.id
    last = responses[-1]
    ids = last.model_extra["prompt_token_ids"]
    assert last.usage.input_tokens == len(ids) > responses[0].usage.input_tokens
    by_hand = [{"role": "user", "content": turns[0]}, *[o.model_dump() for o in responses[0].output],
               {"role": "user", "content": turns[1]}, *[o.model_dump() for o in responses[1].output],
               {"role": "user", "content": turns[2]}]  # fmt: skip
    whole = client.responses.create(**{**kw, "input": by_hand})
    assert whole.model_extra["prompt_token_ids"] == ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": turns[0]},
                {"role": "assistant", "content": responses[0].output_text}, {"role": "user", "content": turns[1]},
                {"role": "assistant", "content": responses[1].output_text}, {"role": "user", "content": turns[2]}]  # fmt: skip
    tokens = client.post("/../tokenize", body={"messages": messages}, cast_to=object)["tokens"]
    assert tokens == ids
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                          extra_body={"guided_regex": THOUGHTS})  # fmt: skip
    assert chat.usage.prompt_tokens == last.usage.input_tokens and chat.choices[0].message.content == last.output_text
    items = client.responses.input_items.list(last.id, order="asc", limit=100).data
    assert [i.type for i in items] == ["message", "reasoning", "message", "message", "reasoning", "message", "message"]
    newest = client.responses.input_items.list(last.id, limit=2)  # desc by default, paged
    assert [i.id for i in newest.data] == [items[-1].id, items[-2].id] and newest.has_more
    rest = client.responses.input_items.list(last.id, limit=100, after=newest.last_id)
    assert [i.id for i in rest.data] == [i.id for i in items[-3::-1]] and not rest.has_more
    client.responses.delete(responses[0].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(responses[0].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(responses[0].id)
    # the later turns hold their own history
    again = client.responses.create(**kw, input=turns[2], previous_response_id=responses[1].id)
    assert again.model_extra["prompt_token_ids"] == ids


def running(base_url: str) -> float:
    return metric(base_url, "vllm:num_requests_running") + metric(base_url, "vllm:num_requests_waiting")


def test_background_retrieve_and_cancel(base_url, client):
    long = dict(model="tiny", input="Count.", max_output_tokens=480, temperature=0, extra_body={"ignore_eos": True})
    r = client.responses.create(**long, background=True)
    assert r.status in ("queued", "in_progress") and r.background and not r.output
    assert client.responses.retrieve(r.id).status == "in_progress"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: as it is
    deadline = time.monotonic() + 10
    while running(base_url) and time.monotonic() < deadline:  # the engine's request was aborted
        time.sleep(0.05)
    assert running(base_url) == 0
    short = client.responses.create(**ANSWER, background=True)
    deadline = time.monotonic() + 30
    while (got := client.responses.retrieve(short.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.status == "completed" and re.fullmatch(r"\n\nThe answer is [0-9]\.", got.output_text)
    assert got.usage.output_tokens_details.reasoning_tokens > 0
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(client.responses.create(**ANSWER).id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "bogus"}]}, "input[0].type"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        ({"input": ["hello"]}, "input[0]"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": []}, "input"),
        ({"input": 7}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
    ],
)  # fmt: skip
def test_malformed_requests_are_400s_naming_the_field(base_url, body, param):
    r = httpx.post(f"{base_url}/v1/responses", json={"model": "tiny", **body},
                   headers={"Authorization": f"Bearer {KEYS[0]}"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_unknown_ids_and_keys(base_url, client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", max_output_tokens=2, previous_response_id="resp_nope")
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel,
                 client.responses.input_items.list):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call("resp_nope")
    r = httpx.get(f"{base_url}/v1/responses/resp_nope", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    bad = httpx.get(f"{base_url}/v1/responses/resp_nope/input_items", params={"limit": 0},
                    headers={"Authorization": f"Bearer {KEYS[0]}"})  # fmt: skip
    assert bad.status_code in (400, 404)
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_structured_output(client):
    """text.format's JSON schema holds the answer; here the template closed the thoughts in the
    prompt (enable_thinking false), so the answer is all there is."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model="tiny", input="Yes?", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "ok", "schema": schema}},
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert r.status == "completed" and [item.type for item in r.output] == ["message"]
    assert set(json.loads(r.output_text)) == {"ok"} and r.text.format.type == "json_schema"
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_restart_keeps_the_stored_responses(model_dir, server, client):
    """Last: a killed server restarted on the same store keeps its responses, and one it was still
    making is failed."""
    done = client.responses.create(**ANSWER)
    busy = client.responses.create(model="tiny", input="Count.", max_output_tokens=480, background=True,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    assert client.responses.retrieve(busy.id).status == "in_progress"
    server[0].proc.kill()  # no shutdown: as a crash
    server[0].proc.wait()
    server.append(serve(model_dir, "restarted.log"))
    client = openai.OpenAI(base_url=f"{server[-1].base_url}/v1", api_key=KEYS[0], max_retries=0)
    assert client.responses.retrieve(done.id).model_dump() == done.model_dump()
    failed = client.responses.retrieve(busy.id)
    assert failed.status == "failed" and "stopped" in failed.error.message
    follow = client.responses.create(**{**ANSWER, "input": "Again?"}, previous_response_id=done.id)
    assert follow.usage.input_tokens > done.usage.input_tokens and follow.status == "completed"
