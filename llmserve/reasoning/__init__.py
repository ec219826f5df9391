"""Reasoning parsers: a reasoning model's thoughts apart from its answer (vLLM's `--reasoning-parser`).

DeepSeek-R1 (and its distills) and Qwen3 in thinking mode write their thoughts between `<think>`
and `</think>`, then the answer. A parser cuts the output text in two: `reasoning` (the
thoughts, without the markers) and `content` (what follows `</think>`). The cut is a pure
function of the text so far (`ReasoningParser.split`), so a stream and a reply cut alike, and a
marker split across tokens or chunks (any byte) is held back until it is whole or proven not to
be one.

Where the thoughts start is read from the prompt's end (`thinking_state`): a chat template that
opens `<think>` in the prompt (R1's newer template, Qwen3-Thinking-2507) starts the output in its
thoughts; one that closes them (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`
writes `<think>\n\n</think>\n\n`) starts it in the answer. Otherwise:
- `deepseek_r1`: the output starts in its thoughts (R1 may not write `<think>`); everything up
  to `</think>` is reasoning, and a leading `<think>` is dropped. Never closed (max_tokens
  reached): all of it is reasoning, no content — as vLLM.
- `qwen3`: the output is in its thoughts only if it begins with `<think>`; then as R1 (never
  closed: all reasoning, as vLLM's stream; vLLM's non-streamed reply calls such an output
  content, which a stream cannot take back, so here both say reasoning). An output without
  `<think>` is all content.

- `gpt_oss`: harmony messages, not `<think>` text (llmserve/reasoning/harmony.py): the analysis
  channel is the reasoning, the final channel the content, function calls become hermes blocks
  for the `openai` tool-call parser. Its markers are special tokens, so its requests keep them
  in the output text (`skip_special_tokens` false).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmserve.reasoning.harmony import GptOssParser
from llmserve.reasoning.split import Split, held

REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")

START, END = "<think>", "</think>"

State = Literal["thinking", "answering", "either", "harmony"]


class UnknownReasoningParserError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One request's parser: `name` and where its output starts (`state`)."""

    name: str
    state: State

    def split(self, text: str, done: bool) -> Split:
        """The output `text` cut in two. While not `done`, an end that may be half a marker
        stays out of both parts (the next call has it)."""
        state = self.state
        if state == "answering":
            return Split("", text)
        if state == "either":  # qwen3 with nothing in the prompt: thoughts only behind a leading <think>
            head = text.lstrip()
            if not head.startswith(START):
                if not done and START.startswith(head):
                    return Split("", None)  # blank, or "<thi": wait
                return Split("", text)
        # in the thoughts: a leading <think> (after blanks) is a marker, not a thought
        head = text.lstrip()
        if head.startswith(START):
            text = head[len(START) :]
        elif not done and START.startswith(head):
            return Split("", None)  # blank, or "<thi": a <think> may be coming
        end = text.find(END)
        if end >= 0:
            return Split(text[:end], text[end + len(END) :])
        if done:
            return Split(text, None)
        return Split(text[: len(text) - held(text, END)], None)


def thinking_state(name: str, prompt_tail: str) -> State:
    """Where the output of parser `name` starts, from the end of the prompt's text."""
    tail = prompt_tail.rstrip()
    opened, closed = tail.rfind(START), tail.rfind(END)
    if closed >= 0 and closed > opened and tail.endswith(END):
        return "answering"  # the template closed the thoughts (enable_thinking false)
    if opened >= 0 and opened > closed and tail.endswith(START):
        return "thinking"  # the template opened them
    return "thinking" if name == "deepseek_r1" else "either"


def reasoning_parser(name: str, prompt_tail: str = "") -> ReasoningParser | GptOssParser:
    """The parser `name` for one request whose prompt ends with `prompt_tail`."""
    if name not in REASONING_PARSERS:
        raise UnknownReasoningParserError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    if name == "gpt_oss":
        return GptOssParser()
    return ReasoningParser(name, thinking_state(name, prompt_tail))


def prompt_tail(tokenizer, ids: list[int], tokens: int = 16) -> str:
    """The text of the prompt's last tokens (where a template opens or closes the thoughts)."""
    return tokenizer.decode(ids[-tokens:], skip_special_tokens=False)
