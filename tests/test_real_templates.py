"""The reasoning and tool-call parsers against the real chat templates of the families they
serve: Qwen3, Llama 3.1, Mistral (Nemo) and gpt-oss, as their model repositories publish them
(copies in tests/fixtures/chat_templates, see its README). None of those models runs here, so a
template is its own oracle: an assistant turn with tool calls (and thoughts), rendered by the real
template as a model is trained to write it, must read back through the parser as the same calls,
thoughts and content, whole and in a stream cut at every character. Also the generation prompts'
thinking states (Qwen3's enable_thinking, gpt-oss's `<|start|>assistant`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reasoning_utils import stream

from llmserve.chat_template import render_chat
from llmserve.config import TINY_MODEL_DIR
from llmserve.openai.chat import reply_parts
from llmserve.openai.protocol import ChatCompletionRequest
from llmserve.openai.tools import conversation, plan_tools
from llmserve.reasoning import reasoning_parser, thinking_state

pytestmark = pytest.mark.unit

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}, "hours": {"type": "integer"}},
    "required": ["zone"]}}}]  # fmt: skip
ARGS = {"zone": "Europe/Paris", "hours": 24}
USER = {"role": "user", "content": "What time is it in Paris?"}


@pytest.fixture(scope="module")
def base_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))


def with_template(tok, name: str):
    tok = tok.__class__.from_pretrained(str(TINY_MODEL_DIR))
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def render(tok, messages, generation: bool, **kwargs) -> str:
    ids = render_chat(tok, conversation(messages), generation, kwargs or None, TOOLS)
    return tok.decode(ids, skip_special_tokens=False)


def assistant_turn(tok, message: dict, end: str, **kwargs) -> tuple[str, str]:
    """(the generation prompt's text, what the template writes for `message` after it, less `end`)."""
    prompt = render(tok, [USER], True, **kwargs)
    full = render(tok, [USER, message], False, **kwargs)
    assert full.startswith(prompt), (prompt[-80:], full[len(prompt) - 80 :])
    turn = full[len(prompt) :]
    assert turn.rstrip().endswith(end), turn[-40:]
    return prompt, turn.rstrip()[: -len(end)] if end else turn


def call_message(call_id: str = "call_0001", **extra) -> dict:
    return {"role": "assistant", "content": None, **extra, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": json.dumps(ARGS)}}]}  # fmt: skip


def read_back(turn: str, tool_parser: str, reasoning: str | None, prompt: str = ""):
    """(reasoning, content, [(name, arguments)], finish) of `turn` read whole, asserting that a
    stream cut at every character gives the same."""
    plan = plan_tools(ChatCompletionRequest(messages=[USER], tools=TOOLS), tool_parser)
    parser = reasoning_parser(reasoning, prompt) if reasoning else None
    whole = reply_parts(turn, "stop", plan, parser)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole[2]]
    for cut in range(1, len(turn)):
        got = stream(parser, [turn[:cut], turn[cut:]], "stop", plan)
        assert (got[0], (got[1] or "").strip() or None) == (whole[0], (whole[1] or "").strip() or None), cut
        assert [c.function.name for c in got[2] if c.function.name] == [name for name, _ in calls], cut
    return whole[0], whole[1], calls, whole[3]


def test_qwen3(base_tokenizer):
    tok = with_template(base_tokenizer, "Qwen-Qwen3-0.6B")
    thoughts = "The user wants the time; I will call get_time."
    prompt, turn = assistant_turn(tok, call_message(reasoning_content=thoughts), "<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n") and thinking_state("qwen3", prompt) == "either"
    assert turn.startswith("<think>\n") and "<tool_call>" in turn
    reasoning, content, calls, finish = read_back(turn, "hermes", "qwen3", prompt)
    assert reasoning.strip() == thoughts and not (content or "").strip()
    assert calls == [("get_time", ARGS)] and finish == "tool_calls"
    # enable_thinking false: the template closes the thoughts in the prompt, the output is all answer
    closed = render(tok, [USER], True, enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n") and thinking_state("qwen3", closed) == "answering"
    answer = {"role": "assistant", "content": "It is noon.", "reasoning_content": "Look it up."}
    _, plain = assistant_turn(tok, answer, "<|im_end|>")
    assert read_back(plain, "hermes", "qwen3", prompt)[:3] == ("\nLook it up.\n", "\n\nIt is noon.", [])


def test_deepseek_r1_parser_on_qwen3_thoughts(base_tokenizer):
    """R1's parser reads Qwen3's thinking output the same way (both write <think>...</think>)."""
    tok = with_template(base_tokenizer, "Qwen-Qwen3-0.6B")
    answer = {"role": "assistant", "content": "It is noon.", "reasoning_content": "Look it up."}
    prompt, plain = assistant_turn(tok, answer, "<|im_end|>")
    assert read_back(plain, "hermes", "deepseek_r1", prompt)[:2] == ("\nLook it up.\n", "\n\nIt is noon.")


def test_llama31(base_tokenizer):
    tok = with_template(base_tokenizer, "meta-llama-Llama-3.1-8B-Instruct")
    prompt, turn = assistant_turn(tok, call_message(), "<|eot_id|>")
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert '"parameters"' in turn  # Llama 3.1 writes its arguments as "parameters"
    reasoning, content, calls, finish = read_back(turn, "llama3_json", None)
    assert reasoning is None and content is None and calls == [("get_time", ARGS)] and finish == "tool_calls"


def test_mistral_nemo(base_tokenizer):
    tok = with_template(base_tokenizer, "mistralai-Mistral-Nemo-Instruct-2407")
    prompt, turn = assistant_turn(tok, call_message("abcDEF123"), tok.eos_token)  # Mistral's ids: 9 characters
    assert prompt.endswith("[/INST]") and turn.startswith("[TOOL_CALLS][")
    assert '"id": "abcDEF123"' in turn  # the template writes the call's id beside its name and arguments
    reasoning, content, calls, finish = read_back(turn, "mistral", None)
    assert content is None and calls == [("get_time", ARGS)] and finish == "tool_calls"


def test_gpt_oss(base_tokenizer):
    tok = with_template(base_tokenizer, "openai-gpt-oss-120b")
    thoughts = "Need the time in Paris."
    prompt, turn = assistant_turn(tok, call_message(reasoning=thoughts), "<|call|>")
    assert prompt.endswith("<|start|>assistant") and turn.startswith("<|channel|>analysis<|message|>")
    assert "to=functions.get_time<|channel|>commentary json<|message|>" in turn
    reasoning, content, calls, finish = read_back(turn, "openai", "gpt_oss", prompt)
    assert reasoning == thoughts and content is None and calls == [("get_time", ARGS)] and finish == "tool_calls"
    # the call alone: the output begins with the header's recipient (` to=functions...`)
    _, bare = assistant_turn(tok, call_message(), "<|call|>")
    assert bare.startswith(" to=functions.get_time")
    assert read_back(bare, "openai", "gpt_oss", prompt)[:3] == (None, None, [("get_time", ARGS)])
    # a final answer after the thoughts (the last turn of a conversation, as in training)
    final = {"role": "assistant", "content": "It is noon.", "reasoning": "Look it up."}
    full = render(tok, [USER, final], False)
    answer = full[len(render(tok, [USER], False)) :].removeprefix("<|start|>assistant").removesuffix("<|return|>")
    assert read_back(answer, "openai", "gpt_oss", prompt)[:3] == ("Look it up.", "It is noon.", [])
