"""The gpt_oss reasoning parser (llmserve/reasoning/harmony.py) and the `openai` tool-call parser
on gpt-oss's harmony messages: analysis as reasoning, final as content, function calls as tool
calls; every cut of the text across stream chunks; an output cut short; built-in tool messages;
a malformed call; the reasoning-token count on a tokenizer that holds the markers as special
tokens; constraints refused unless they spell the messages out. The server path is in
tests/test_reasoning_server.py."""

from __future__ import annotations

import json
import logging

import pytest
from reasoning_utils import stream

from llmserve.config import TINY_MODEL_DIR
from llmserve.openai.chat import reasoning_tokens, reply_parts
from llmserve.openai.protocol import ChatCompletionRequest
from llmserve.openai.tools import plan_tools
from llmserve.reasoning import reasoning_parser
from llmserve.reasoning.grammar import after_thoughts
from llmserve.reasoning.harmony import MARKERS, read_header
from llmserve.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.unit

THOUGHT = "The user asks 2+2 <b>; é你好 <|x is not a marker."
ANSWER = "It is 4."
OUTPUT = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
          f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")  # fmt: skip
CALL_OUTPUT = (
    "<|channel|>analysis<|message|>Need the time.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
    '{"zone": "UTC"}<|call|>'
)
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}]  # fmt: skip


def test_analysis_is_reasoning_and_final_is_content():
    parser = reasoning_parser("gpt_oss")
    assert parser.state == "harmony"
    assert reply_parts(OUTPUT, "stop", None, parser) == (THOUGHT, ANSWER, [], "stop")
    # the stop token (<|return|>) is not in the text the engine returns: the same cut
    assert reply_parts(OUTPUT.removesuffix("<|return|>"), "stop", None, parser)[:2] == (THOUGHT, ANSWER)
    for a in range(1, len(OUTPUT)):  # two chunks, cut everywhere (markers split too)
        assert stream(parser, [OUTPUT[:a], OUTPUT[a:]])[:2] == (THOUGHT, ANSWER), a
    assert stream(parser, list(OUTPUT))[:2] == (THOUGHT, ANSWER)  # a character at a time


def test_the_cut_only_grows():
    """Each prefix's reasoning and content are prefixes of the whole output's (a stream never takes back)."""
    parser = reasoning_parser("gpt_oss")
    whole = parser.split(CALL_OUTPUT, done=True)
    for n in range(len(CALL_OUTPUT) + 1):
        cut = parser.split(CALL_OUTPUT[:n], done=False)
        assert whole.reasoning.startswith(cut.reasoning), n
        assert cut.content is None or whole.content.startswith(cut.content), n
        assert not any(m in (cut.content or "") + cut.reasoning for m in MARKERS), n


def test_cut_short_and_plain_text():
    parser = reasoning_parser("gpt_oss")
    short = "<|channel|>analysis<|message|>Let me think about <|"
    assert reply_parts(short, "length", None, parser) == ("Let me think about <|", None, [], "length")
    assert stream(parser, [short[:20], short[20:]], "length")[:2] == ("Let me think about <|", None)
    header_only = "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>fin"
    assert reply_parts(header_only, "length", None, parser)[:2] == ("ok", None)
    assert reply_parts("Just text, no harmony.", "stop", None, parser)[:2] == (None, "Just text, no harmony.")
    assert stream(parser, ["<|cha", "nnel|>final<|message|>", "Hi"])[:2] == (None, "Hi")


def test_built_in_tools_and_preambles():
    parser = reasoning_parser("gpt_oss")
    text = (
        "<|channel|>analysis<|message|>Search first.<|end|>"
        '<|start|>assistant to=browser.search<|channel|>analysis<|message|>{"query": "x"}<|end|>'
        "<|start|>assistant<|channel|>commentary<|message|>Checking now. <|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    )
    assert reply_parts(text, "stop", None, parser)[:2] == ('Search first.\n{"query": "x"}', "Checking now. Done.")
    assert read_header("assistant to=functions.f<|channel|>commentary json") == read_header(
        "<|channel|>commentary to=functions.f <|constrain|>json"
    )
    assert read_header("<|channel|>commentary to=functions.f").function == "f"


def test_function_calls(caplog):
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "time?"}], tools=TOOLS), "openai")
    parser = reasoning_parser("gpt_oss")
    reasoning, content, calls, finish = reply_parts(CALL_OUTPUT, "stop", plan, parser)
    assert reasoning == "Need the time." and content is None and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    for a in range(1, len(CALL_OUTPUT), 7):
        out = stream(parser, [CALL_OUTPUT[:a], CALL_OUTPUT[a:]], tools=plan)
        assert out[0] == reasoning and not out[1] and out[3] == "tool_calls", a
        assert [(c.function.name, c.function.arguments) for c in out[2]] == [("get_time", calls[0].function.arguments)]
    with caplog.at_level(logging.WARNING):  # arguments that are not JSON: content, with a log line
        bad = CALL_OUTPUT.replace('{"zone": "UTC"}', '{"zone": UTC')
        _, content, calls, finish = reply_parts(bad, "stop", plan, parser)
    assert calls == [] and '{"zone": UTC' in content and finish == "stop"
    assert "tool-call parser openai" in caplog.text


def test_reasoning_tokens_with_special_token_markers():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    text = tok.decode(ids, skip_special_tokens=False)
    parser = reasoning_parser("gpt_oss")
    assert reply_parts(text, "stop", None, parser)[:2] == (THOUGHT, ANSWER)
    n = reasoning_tokens(tok, ids, text, parser)
    head = tok.decode(ids[:n], skip_special_tokens=False)
    assert head.endswith("<|channel|>final<|message|>") and ANSWER not in head
    assert reasoning_tokens(tok, ids[:5], tok.decode(ids[:5], skip_special_tokens=False), parser) == 5


def test_constraints():
    harmony = StructuredOutputsParams(regex=r"<\|channel\|>final<\|message\|>[a-z]+")
    assert after_thoughts(harmony, "harmony") is harmony
    with pytest.raises(ValueError, match="gpt_oss"):
        after_thoughts(StructuredOutputsParams(json={"type": "object"}), "harmony")
