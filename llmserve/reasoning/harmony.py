"""The `gpt_oss` reasoning parser: gpt-oss writes its output as harmony messages, not as text
between `<think>` markers.

After the prompt's `<|start|>assistant`, each message is a header, `<|message|>`, a body and an
end marker (`<|end|>`, or `<|return|>` / `<|call|>` which also end the output); the next message
opens with `<|start|>assistant`. The header names the channel (`<|channel|>analysis`) and, for a
tool call, the recipient (`to=functions.get_weather`, before or after the channel) and the
arguments' format (`<|constrain|>json`):

    <|channel|>analysis<|message|>The user asks...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The parser cuts that text (decoded with the special tokens kept) into:
- reasoning: the bodies of `analysis` messages, and of messages to a built-in tool
  (`to=browser.search`, `to=python`), which the server does not run;
- content: the bodies of `final` messages and of `commentary` messages without a recipient
  (preambles), followed by each function call as a hermes block,
  `<tool_call>{"name": NAME, "arguments": BODY}</tool_call>`, which the `openai` tool-call parser
  (openai/tool_parsers.py) reads as any hermes call. An output with no header at all is content.

As the `<think>` parsers, the cut is a pure function of the text so far and only grows as the
text does: a header is read once `<|message|>` closes it, a half-written marker at the end of a
body is held back, and a call's closing `}</tool_call>` is written when its message ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llmserve.reasoning.split import Split, held

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
# how an output may begin after the prompt's `<|start|>assistant`: a header (the recipient may
# come first: ` to=functions.f<|channel|>commentary json<|message|>`) or a next message
OPENERS = (START, CHANNEL, "to=")

_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


@dataclass(frozen=True, slots=True)
class Header:
    """What a message's header says: its channel and recipient ("" for none)."""

    channel: str
    recipient: str

    @property
    def function(self) -> str | None:
        """The function a tool call names (None: not a function call)."""
        return self.recipient.removeprefix("functions.") if self.recipient.startswith("functions.") else None

    @property
    def is_reasoning(self) -> bool:
        return self.channel == "analysis" or (bool(self.recipient) and self.function is None)


def read_header(text: str) -> Header:
    """The header text between a message's start and `<|message|>`."""
    channel = _CHANNEL.search(text)
    recipient = _RECIPIENT.search(text)
    return Header(channel.group(1) if channel else "", recipient.group(1) if recipient else "")


def _first_end(text: str, start: int) -> tuple[int, int]:
    """(where the first end marker at or after `start` begins, its length); (-1, 0) if none."""
    found = [(i, len(m)) for m in ENDS if (i := text.find(m, start)) >= 0]
    return min(found) if found else (-1, 0)


def _call_block(name: str, body: str, closed: bool) -> str:
    return (
        '<tool_call>{"name": '
        + json.dumps(name, ensure_ascii=False)
        + ', "arguments": '
        + body
        + ("}</tool_call>" if closed else "")
    )


@dataclass(frozen=True, slots=True)
class GptOssParser:
    """One request's harmony parser (the `ReasoningParser` shape: `name`, `state`, `split`)."""

    name: str = "gpt_oss"
    state: str = "harmony"

    def split(self, text: str, done: bool) -> Split:
        head = text.lstrip()
        if not head.startswith(OPENERS):
            if not done and any(m.startswith(head) for m in OPENERS):
                return Split("", None)  # blank, or "<|chan": a header may be coming
            return Split("", text)  # no harmony at all: plain content
        thoughts: list[str] = []
        answer: list[str] | None = None
        pos = len(text) - len(head)
        while pos < len(text):
            body_at = text.find(MESSAGE, pos)
            if body_at < 0:
                break  # the header is not whole yet (or, done, never was: nothing to show)
            header = read_header(text[pos:body_at])
            body_start = body_at + len(MESSAGE)
            end, width = _first_end(text, body_start)
            closed = end >= 0 or done
            if end < 0:
                end = len(text) if done else len(text) - max(held(text, m) for m in MARKERS)
            body = text[body_start:end]
            if header.is_reasoning:
                thoughts.append(body)
            else:
                part = _call_block(header.function, body, closed) if header.function is not None else body
                answer = [*(answer or []), part]
            if width == 0:
                break
            pos = end + width
            if text.startswith(START, pos):
                pos += len(START)
            elif not done and START.startswith(text[pos:]):
                break  # "<|sta": the next message's start is still coming
        return Split("\n".join(thoughts), "".join(answer) if answer is not None else None)
