"""Tool calling in `/v1/chat/completions`: OpenAI's `tools` and `tool_choice`, as vLLM does it.

- a named function (`{"type": "function", "function": {"name": ...}}`): the output is
  constrained (structured outputs) to that function's parameters schema; the output is the
  call's arguments. finish_reason "stop".
- "required": constrained to a JSON array of `{"name": ..., "parameters": ...}` objects, each
  one of the tools (a single call when `parallel_tool_calls` is false). finish_reason
  "tool_calls".
- "auto" (the default when tools are given): the model decides; the server's tool-call parser
  reads its output (`--enable-auto-tool-choice --tool-call-parser NAME`: hermes, llama3_json,
  mistral, pythonic, qwen3_coder; `tool_parsers.py`). A call the parser cannot read leaves the
  output as content, with a warning in the log. Without a parser "auto" is a 400, as in vLLM.
- "none": the tools only reach the chat template.

The tools always reach the chat template (`tools=`), as in vLLM. At most MAX_TOOLS tools (OpenAI's
limit). How a stream sends each mode: `ToolStream`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from llmserve.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    random_id,
    schema_text,
)
from llmserve.openai.tool_parsers import PARSERS, HermesParser, ToolCallFormatError
from llmserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

TOOL_CALL_PARSERS = tuple(PARSERS)
MAX_TOOLS = 128


class AutoToolChoiceUnavailable(ValueError):
    """tool_choice "auto" where no tool-call parser reads the model's output."""


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are served."""

    mode: Literal["none", "auto", "required", "named"]
    template_tools: list[dict] | None  # what the chat template gets as `tools`
    constraint: StructuredOutputsParams | None  # the output constraint the mode needs
    function: str | None = None  # the named function
    single_call: bool = False  # parallel_tool_calls false ("auto": the first call only)
    parser: str = "hermes"  # "auto": the tool-call parser that reads the output

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output."""
        if self.mode == "named":
            return None, [ToolCall(function=FunctionCall(name=self.function, arguments=text))]
        if self.mode == "required":
            return _parse_required(text)
        if self.mode == "auto":
            try:
                content, calls = PARSERS[self.parser].parse(text, self.template_tools)
            except ToolCallFormatError as exc:
                logger.warning("tool-call parser %s: the model wrote a call it cannot read (%s); the output is "
                               "returned as content", self.parser, exc)  # fmt: skip
                return text, []
            return content, calls[:1] if self.single_call else calls
        return text, []

    def streamable_text(self, text: str) -> int:
        """How much of a still-growing output a stream may send as content now: all of it
        without tools or with "none"; with "auto" what comes before a (possibly half-written)
        call marker of the parser; nothing with "required" (its text is the calls)."""
        if self.mode == "required":
            return 0
        if self.mode != "auto":
            return len(text)
        return PARSERS[self.parser].content_end(text)

    def finish_reason(self, calls: list[ToolCall], finish_reason: str | None) -> str | None:
        """OpenAI's and vLLM's: "tool_calls" when the model chose to call (auto, required)."""
        if calls and self.mode in ("auto", "required") and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

    def reply(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of a finished output."""
        content, calls = self.parse(text)
        return content, calls, self.finish_reason(calls, finish_reason)


class ToolStream:
    """The stream of one choice's message from its growing text: plain text as content
    deltas; a named tool's text as argument deltas of one call; "required" calls each as its
    id and name once the name is complete, then its arguments as they grow; "auto" text as
    content up to a (possibly half-written) `<tool_call>`, the calls when the output ends.
    Output that holds no readable calls at its end goes out as content, as in the reply."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan or NO_TOOLS
        self.chars = 0  # of the text sent as content (or as a named call's arguments)
        self.calls: list[list] = []  # "required": per call [id, chars of its arguments sent]
        self.call_id = random_id("chatcmpl-tool")  # a named call's
        self.named_started = False  # its first delta (id, name) went out

    def step(self, text: str, finish_reason: str | None) -> tuple[str | None, list[DeltaToolCall], str | None] | None:
        """(content, tool call deltas, finish reason) new since the last step, for the
        cumulative `text`; None when there is nothing to send yet."""
        plan, done = self.plan, finish_reason is not None
        _, final_calls, finish_reason = plan.reply(text, finish_reason) if done else (None, [], None)
        calls: list[DeltaToolCall] = []
        content = ""
        if plan.mode == "named":
            first, self.named_started = not self.named_started, True
            new, self.chars = text[self.chars :], len(text)
            if new or first:
                calls = [DeltaToolCall(index=0, id=self.call_id if first else None, type="function" if first else None,
                                       function=DeltaFunctionCall(name=plan.function if first else None, arguments=new))]  # fmt: skip
        elif plan.mode == "required":
            calls = self._call_deltas(text)
            # unreadable at the end (cut short): the text as content, unless parts of calls went out
            content = text if done and not final_calls and not self.calls else ""
        else:  # none, auto
            end = plan.streamable_text(text) if final_calls or not done else len(text)
            content, self.chars = text[self.chars : end], max(self.chars, end)
            calls = [DeltaToolCall(index=k, id=c.id, type="function", function=DeltaFunctionCall(**c.function.model_dump()))
                     for k, c in enumerate(final_calls)]  # fmt: skip
        if not content and not calls and not done:
            return None
        return content or None, calls, finish_reason

    def _call_deltas(self, text: str) -> list[DeltaToolCall]:
        out = []
        for k, call in enumerate(scan_calls(text)):
            if call.name is None:
                break
            head = k == len(self.calls)
            if head:
                self.calls.append([random_id("chatcmpl-tool"), 0])
            new = call.arguments[self.calls[k][1] :]
            if not head and not new:
                continue
            self.calls[k][1] = len(call.arguments)
            out.append(DeltaToolCall(
                index=k, id=self.calls[k][0] if head else None, type="function" if head else None,
                function=DeltaFunctionCall(name=call.name if head else None, arguments=new),
            ))  # fmt: skip
        return out


NO_TOOLS = ToolPlan("none", None, None)  # a request without tools: its text is its content


def template_tools(tools: list) -> list[dict]:
    """Function tools as chat templates take them (`tools=`)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """The request's tool plan (None: no tools involved); ValueError: a 400."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools; got {len(tools)}")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tool function names must be unique")
    for t in tools:  # arguments are a JSON object (OpenAI's rule)
        if (t.function.parameters or {}).get("type", "object") != "object":
            raise ValueError(f"the parameters of tool {t.function.name!r} must be a JSON schema of an object")
    shown = template_tools(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", shown, None)
    if choice != "auto" and req.structured_outputs_params() is not None:  # they constrain the output themselves
        raise ValueError("a named or required tool_choice cannot be combined with response_format, "
                         "structured_outputs or guided_* fields")  # fmt: skip
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        params = _object_schema(tools[names.index(name)].function.parameters)
        return ToolPlan("named", shown, StructuredOutputsParams(json=_schema(params)), function=name)
    if choice == "required":
        return ToolPlan("required", shown, StructuredOutputsParams(json=_schema(
            _required_schema(tools, single=req.parallel_tool_calls is False))))  # fmt: skip
    if parser is None:
        raise AutoToolChoiceUnavailable('"auto" tool choice needs a server started with --enable-auto-tool-choice and '
                                        '--tool-call-parser; use tool_choice "required" or a named function instead')  # fmt: skip
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")
    return ToolPlan("auto", shown, None, single_call=req.parallel_tool_calls is False, parser=parser)


def _required_schema(tools: list, single: bool) -> dict:
    """A JSON array of calls, each `{"name": <a tool>, "parameters": <its schema>}`. The
    tools' `$defs` move to the top, where their `#/$defs/...` references resolve."""
    defs: dict[str, Any] = {}
    choices = []
    for t in tools:
        params = _object_schema(t.function.parameters)
        for key in ("$defs", "definitions"):
            for name, definition in (params.pop(key, None) or {}).items():
                if defs.setdefault(name, definition) != definition:
                    raise ValueError(f"tools define $defs {name!r} differently: give one of them another name")
        choices.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                         "parameters": params},
                        "required": ["name", "parameters"], "additionalProperties": False})  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if single:
        schema["maxItems"] = 1
    if defs:  # both spellings resolve: "#/$defs/X" and "#/definitions/X"
        schema["$defs"] = defs
        schema["definitions"] = defs
    return schema


def _object_schema(parameters: dict | None) -> dict:
    """A function's parameters schema, held to an object (a schema without "type" would let
    the grammar write any JSON value as the arguments)."""
    return {**(parameters or {}), "type": "object"}


def _schema(schema: dict) -> str:
    return schema_text(schema, "a tool's parameters schema")


def _parse_required(text: str) -> tuple[str | None, list[ToolCall]]:
    """The calls of a finished "required" output; their arguments are the model's own text
    of each `parameters` object (what a stream sent, piece by piece)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # cut short (max_tokens), or nested past the parser: the text as content
        return text, []
    calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in scan_calls(text) if c.name]
    return None, calls


@dataclass
class CallProgress:
    """One call of a (possibly unfinished) "required" output."""

    name: str | None = None
    arguments: str = ""  # the `parameters` value's text so far
    done: bool = False  # its `parameters` value is complete


def scan_calls(text: str) -> list[CallProgress]:
    """The calls of a "required" output so far, `[{"name": ..., "parameters": {...}}, ...]`,
    read from a prefix that may stop anywhere: each call's name once its string is complete,
    and its `parameters` text as far as it goes. A character scan (strings and escapes,
    container depth), since no JSON parser reads a prefix."""
    calls: list[CallProgress] = []
    depth = 0  # 1: in the array, 2: in a call object, deeper: in a value
    in_string = escaped = False
    string_start = 0
    key: str | None = None  # a call-level key read, before its ':'
    value_of: str | None = None  # the call-level key whose value is being read
    value_start: int | None = None
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2:
                    literal = _string(text[string_start : i + 1])
                    if value_of is None:
                        key = literal
                    elif value_of == "name" and value_start == string_start:
                        calls[-1].name, value_of = literal, None
            continue
        at_value = depth == 2 and value_of is not None and value_start is None and not ch.isspace()
        if at_value:
            value_start = i
        if ch == '"':
            in_string, string_start = True, i
        elif ch in "[{":
            if depth == 1 and ch == "{":
                calls.append(CallProgress())
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 2 and value_of == "parameters" and value_start is not None:
                calls[-1].arguments, calls[-1].done = text[value_start : i + 1], True
                value_of = value_start = None
        elif depth == 2 and ch == ":" and key is not None:
            value_of, key, value_start = key, None, None
        elif depth == 2 and ch == ",":
            value_of = value_start = None
    if calls and value_of == "parameters" and value_start is not None:
        calls[-1].arguments = text[value_start:]
    return calls


def _string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:
        return None


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks -> (content, calls); a
    block that is not such JSON leaves the whole text as content, with no calls."""
    try:
        return HermesParser().parse(text)
    except ToolCallFormatError:
        return text, []


def conversation(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped message dicts, checked and written out as `template_messages` does
    (pydantic's ValidationError, a ValueError, for a bad one)."""
    return template_messages([ChatMessage.model_validate(m) for m in messages])


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as chat templates take it: assistant tool calls (their arguments as
    objects, which templates render with `tojson`), tool results with their call ids, and an
    assistant's earlier thoughts as the templates name them (`reasoning_content`: Qwen3's and
    R1's; `thinking`: gpt-oss's)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        thoughts = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thoughts is not None and m.role == "assistant":
            msg["reasoning_content"] = msg["thinking"] = thoughts
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _as_object(c.function.arguments)}}
                for c in m.tool_calls
            ]  # fmt: skip
        out.append(msg)
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
