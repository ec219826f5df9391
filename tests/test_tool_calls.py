"""Tool calling in /v1/chat/completions (`serve/tools.py`): named, required and auto
(hermes parser), streamed and not, through the official openai client against a real
server on the tiny model; the parser and the plans on their own; bad requests get 400s."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from server_utils import start_server

from llmserve.config import TINY_MODEL_DIR
from llmserve.openai.protocol import ChatCompletionRequest
from llmserve.openai.tools import TOOL_CALL_PARSERS, ToolStream, parse_hermes, plan_tools, scan_calls

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    assert args["unit"] in ("c", "f")


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **kw)


def test_hermes_parser():
    content, calls = parse_hermes(
        'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    assert content == "Sure.\n" and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"})
    ]
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    content, calls = parse_hermes(two)
    assert content is None and [c.function.name for c in calls] == ["a", "b"] and calls[0].id != calls[1].id
    unterminated = '<tool_call>{"name": "a", "arguments": {"k": "v"}}'
    assert parse_hermes(unterminated)[1][0].function.arguments == '{"k": "v"}'
    for text in (
        "no calls here",
        '<tool_call>{"name": "a", "argu',
        "<tool_call>[1, 2]</tool_call>",
        "<tool_call>" + "[" * 100_000,
    ):  # nested past the JSON parser's recursion limit
        assert parse_hermes(text) == (text, [])  # not a well-formed call: the text stays content


def test_tool_stream_cuts_text_into_deltas():
    named = ToolStream(
        plan_tools(
            request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), None
        )
    )
    first = named.step("", None)[1][0]  # a first step with no text yet still names the call, once
    assert first.id and first.function.name == "get_weather" and first.function.arguments == ""
    later = named.step('{"city"', None)[1][0]
    assert later.id is None and later.function.name is None and later.function.arguments == '{"city"'
    assert named.step('{"city"', None) is None and named.step('{"city": "X"}', "stop")[2] == "stop"
    plain = ToolStream(None)
    assert plain.step("Hel", None) == ("Hel", [], None) and plain.step("Hello", "length") == ("lo", [], "length")
    auto = ToolStream(plan_tools(request(tools=[WEATHER]), "hermes"))
    assert auto.step("Ok <tool", None) == ("Ok ", [], None) and auto.step("Ok <tool_call>{", None) is None
    content, calls, finish = auto.step(
        'Ok <tool_call>{"name": "get_weather", "arguments": {"city": "X"}}</tool_call>', "stop"
    )
    assert content is None and calls[0].function.name == "get_weather" and finish == "tool_calls"


def test_a_required_stream_cut_short():
    plan = plan_tools(request(tools=[WEATHER], tool_choice="required"), None)
    partial = ToolStream(plan)
    assert partial.step('[{"name": "get_weather", "parameters": {"ci', None)[1][0].function.name == "get_weather"
    content, calls, finish = partial.step('[{"name": "get_weather", "parameters": {"city": "Par', "length")
    assert content is None and calls[0].function.arguments == 'ty": "Par' and finish == "length"  # not sent twice
    early = ToolStream(plan)
    assert early.step('[{"na', None) is None
    assert early.step('[{"nam', "length") == ('[{"nam', [], "length")  # no call went out: the text, as in the reply
    assert plan.parse('[{"nam') == ('[{"nam', [])


def test_streamable_text_holds_back_what_may_be_a_call():
    auto = plan_tools(request(tools=[WEATHER]), "hermes")
    assert auto.streamable_text("Let me check.") == len("Let me check.")
    assert auto.streamable_text("Let me check. <tool_c") == len("Let me check. ")  # a tag half written
    assert auto.streamable_text("Hi <tool_call>{") == 3 and auto.streamable_text("a <b") == 4
    assert plan_tools(request(tools=[WEATHER], tool_choice="required"), None).streamable_text("[{") == 0


def test_plans():
    assert plan_tools(request(), None) is None
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), None).template_tools  # as vLLM: still shown
    named = plan_tools(
        request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}), None
    )
    assert named.mode == "named" and json.loads(named.constraint.json) == TIME["function"]["parameters"]
    assert [t["function"]["name"] for t in named.template_tools] == ["get_weather", "get_time"]
    required = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), None)
    schema = json.loads(required.constraint.json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert plan_tools(request(tools=[WEATHER]), "hermes").mode == "auto"  # the default with tools
    defs = {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}}}}}}  # fmt: skip
    schema = json.loads(plan_tools(request(tools=[defs, WEATHER], tool_choice="required"), None).constraint.json)
    assert schema["$defs"] == {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    loose = {"type": "function", "function": {"name": "loose", "parameters": {"description": "no type"}}}
    named = plan_tools(request(tools=[loose], tool_choice={"type": "function", "function": {"name": "loose"}}), None)
    assert json.loads(named.constraint.json)["type"] == "object"  # arguments are always an object
    assert TOOL_CALL_PARSERS == (
        "hermes",
        "llama3_json",
        "mistral",
        "pythonic",
        "qwen3_coder",
        "openai",
    )  # the serve CLI's --tool-call-parser choices


@pytest.mark.parametrize("kw,message", [
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=[WEATHER]), '"auto" tool choice needs a server started with'),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "unique"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "of an object"),
    (dict(tools=[WEATHER], tool_choice="required", guided_regex="a"), "cannot be combined"),
    (dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], tool_choice="required"),
     "at most 128 tools"),
    (dict(tools=[{"type": "function", "function": {"name": n, "parameters": {"$defs": {"A": {"type": t}}}}}
                 for n, t in (("a", "string"), ("b", "integer"))], tool_choice="required"), "differently"),
])  # fmt: skip
def test_bad_plans(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        plan_tools(request(**kw), None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny model, its chat template taught to show the tools (as Qwen's does)."""
    root = tmp_path_factory.mktemp("tools")
    model = root / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>{%- endif %}" + config["chat_template"]
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    srv = start_server([str(model), "--max-model-len", "1024", "--served-model-name", "tiny",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], str(root / "server.log"))  # fmt: skip
    yield srv
    srv.stop()


def test_the_tools_reach_the_template_and_tokenize_counts_them(server, client):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    without = client.chat.completions.create(**body).usage.prompt_tokens
    shown = client.chat.completions.create(**body, tools=[WEATHER, TIME], tool_choice="none").usage.prompt_tokens
    assert shown > without + 50  # the functions' JSON is in the prompt
    counted = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, "tools": [WEATHER, TIME]}).json()
    assert counted["count"] == shown


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def test_named_function_streamed_and_not(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60, temperature=0)
    done = client.chat.completions.create(**kw)
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "stop" and not msg.content
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather" and msg.tool_calls[0].id
    check_weather(msg.tool_calls[0].function.arguments)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and all(t.index == 0 for t in calls)
    assert "".join(t.function.arguments or "" for t in calls) == msg.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_streamed_and_not(client, parallel):
    kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=400,
              temperature=0, parallel_tool_calls=parallel)  # fmt: skip
    done = client.chat.completions.create(**kw)
    calls = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            check_weather(call.function.arguments)
        else:
            assert set(json.loads(call.function.arguments)) == {"zone"}
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assembled: dict[int, list[str]] = {}
    for delta in (t for c in chunks for t in (c.choices[0].delta.tool_calls or [])):
        if delta.index not in assembled:  # a call's first delta names it and gives its id
            assert delta.id and delta.function.name and delta.index == len(assembled)
            assembled[delta.index] = [delta.function.name, ""]
        else:
            assert delta.id is None and delta.function.name is None
        assembled[delta.index][1] += delta.function.arguments or ""
    assert [tuple(v) for v in assembled.values()] == [(c.function.name, c.function.arguments) for c in calls]
    deltas = sum(len(c.choices[0].delta.tool_calls or []) for c in chunks)
    assert deltas > 2 * len(calls)  # the arguments came piece by piece, not at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_scan_calls_reads_any_prefix():
    text = '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "u": [1, {"x": "}"}]}}, {"name": "get_time", "parameters": {"zone": "UTC"}}]'
    final = [(c.name, c.arguments, c.done) for c in scan_calls(text)]
    assert final == [
        ("get_weather", '{"city": "Pa\\"ris}", "u": [1, {"x": "}"}]}', True),
        ("get_time", '{"zone": "UTC"}', True),
    ]
    for k in range(len(text)):  # every prefix: names once whole, arguments a prefix of the final ones
        for got, (name, arguments, _) in zip(scan_calls(text[:k]), final):
            assert got.name in (None, name) and arguments.startswith(got.arguments)
            assert not got.arguments or got.name == name


def test_auto_parses_hermes_calls(client):
    """The tiny model does not write tool calls by itself: a regex holds it to the hermes
    format, which the parser must then read back (as it would from a Qwen model)."""
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}</tool_call>'
    kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
              extra_body={"guided_regex": "Let me check\\. " + call})  # fmt: skip
    done = client.chat.completions.create(**kw)
    calls, reason = done.choices[0].message.tool_calls, done.choices[0].finish_reason
    assert done.choices[0].message.content == "Let me check. "
    assert reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_time"
    assert len(json.loads(calls[0].function.arguments)["zone"]) == 3
    chunks = [c for c in client.chat.completions.create(**kw, stream=True, logprobs=True) if c.choices]
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(texts) > 1 and "".join(texts) == "Let me check. "  # the content streamed before the call
    streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (calls[0].function.name, calls[0].function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    logprobs = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(logprobs) == done.usage.completion_tokens  # every token's logprob, once
    two = client.chat.completions.create(
        **{**kw, "extra_body": {"guided_regex": call + call}, "parallel_tool_calls": False}
    )
    assert len(two.choices[0].message.tool_calls) == 1  # parallel_tool_calls false: the first call only
    assert (
        len(
            client.chat.completions.create(**{**kw, "extra_body": {"guided_regex": call + call}})
            .choices[0]
            .message.tool_calls
        )
        == 2
    )
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.tool_calls in (None, []) and plain.choices[0].finish_reason == "length"


def test_a_conversation_with_calls_and_results(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    done = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert done.choices[0].message.content is not None and done.usage.prompt_tokens > 20
    deep = [MESSAGES[0], {"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]  # fmt: skip
    assert client.chat.completions.create(model="tiny", messages=deep, max_tokens=3).choices  # kept as text, not a 500


@pytest.mark.parametrize("body,message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
    ({"tools": [{"type": "function"}]}, None),
    ({"tools": "get_weather"}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"},
     "invalid structured output (json)"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])  # fmt: skip
def test_bad_tool_requests_get_a_400(server, body, message):
    for stream in (False, True):
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 5, "stream": stream, **body},
        )
        assert r.status_code == 400, r.text
        assert message is None or message in r.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_auto_without_a_parser_is_a_400(tmp_path):
    srv = start_server([str(TINY_MODEL_DIR), "--max-model-len", "256"], str(tmp_path / "server.log"))
    try:
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER]})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(
            f"{srv.base_url}/v1/chat/completions",
            json={"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []
    finally:
        srv.stop()
