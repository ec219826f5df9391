"""Tool-call parsers: the calls a model writes in its own format, read back (vLLM's
`--tool-call-parser`), for tool_choice "auto".

- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- `llama3_json` (Llama 3.1/3.2/3.3): the output is `{"name": ..., "parameters": {...}}` objects
  (separated by `;`), optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (v3
  tokenizers), or `name[ARGS]{...}` calls each after `[TOOL_CALLS]` (v11+ tokenizers).
- `pythonic` (Llama 3.2/4, ToolACE): the output is a Python list of calls with keyword
  arguments of literal values, `[get_weather(city="Paris"), get_time(zone="UTC")]`, optionally
  inside `<|python_start|>` ... `<|python_end|>`.
- `openai` (gpt-oss, with `--reasoning-parser gpt_oss`): the calls are harmony messages to
  `functions.NAME`, which the reasoning parser (llmserve/reasoning/harmony.py) hands on as hermes
  blocks; read as `hermes` reads them.
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>value</parameter>...
  </function></tool_call>`; the values are text, converted by the tool's parameter schema
  (integer, number, boolean, object, array) as vLLM does.

Each parser says how much of a growing output a stream may send as content (`content_end`:
the text before a call's first marker, a half-written marker held back) and reads a finished
output (`parse`). Text with no call in it is content. A call that is started but not readable
raises ToolCallFormatError, which the plan turns into content and a log line.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from llmserve.openai.protocol import FunctionCall, ToolCall


class ToolCallFormatError(ValueError):
    """The output starts a tool call the parser cannot read."""


def _held(text: str, marker: str) -> int:
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


def until_markers(text: str, markers: tuple[str, ...]) -> int:
    """Where the first of `markers` begins in `text`, or (none whole yet) the end less any
    tail that may be one half written."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found)
    return len(text) - max(_held(text, m) for m in markers)


def _leading(text: str, starts: tuple[str, ...]) -> int:
    """For formats whose calls are the whole output: 0 (hold everything) while the output,
    blanks aside, is empty or begins (or may begin) with one of `starts`; else all of it."""
    head = text.lstrip()
    if not head or any(head.startswith(s) or s.startswith(head) for s in starts):
        return 0
    return len(text)


def _call(name: Any, arguments: Any) -> ToolCall:
    if not isinstance(name, str) or not name:
        raise ToolCallFormatError(f"a call's name must be a string, got {name!r:.80}")
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            raise ToolCallFormatError(f"the arguments of {name!r} are not JSON") from None
    if not isinstance(arguments, dict):
        raise ToolCallFormatError(f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ToolCallFormatError(f"{what} is not JSON: {text!r:.120}") from None


def _content(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    name = ""
    markers: tuple[str, ...] = ()

    def content_end(self, text: str) -> int:
        return until_markers(text, self.markers)

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text, tools=None):
        """The text before the first block is the content; text between and after the blocks
        is dropped (as vLLM does); an unterminated last block is read to the end."""
        if self.markers[0] not in text:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text):
            call = _json(block, "a <tool_call> block")
            if not isinstance(call, dict):
                raise ToolCallFormatError(f"a <tool_call> block must hold a JSON object, got {block!r:.80}")
            calls.append(_call(call.get("name"), call.get("arguments", {})))
        return _content(text[: text.index(self.markers[0])]), calls


class OpenAIParser(HermesParser):
    """gpt-oss's function calls, as the gpt_oss reasoning parser writes them (hermes blocks)."""

    name = "openai"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def content_end(self, text):
        return _leading(text, (self.TAG, "{"))

    def parse(self, text, tools=None):
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        elif not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                call, i = decoder.raw_decode(body, i)
            except (ValueError, RecursionError):
                raise ToolCallFormatError(f"not a JSON call at character {i}: {body[i:]!r:.120}") from None
            if not isinstance(call, dict):
                raise ToolCallFormatError(f"a call must be a JSON object, got {type(call).__name__}")
            calls.append(_call(call.get("name"), call.get("parameters", call.get("arguments", {}))))
            while i < len(body) and (body[i].isspace() or body[i] == ";"):
                i += 1
        if not calls:
            raise ToolCallFormatError("no call after <|python_tag|>")
        return None, calls


class MistralParser(ToolParser):
    name = "mistral"
    TAG = "[TOOL_CALLS]"
    markers = (TAG,)
    _NAME = re.compile(r"\s*([A-Za-z0-9_\-.]+)\s*(?:\[ARGS\])?\s*")

    def parse(self, text, tools=None):
        if self.TAG not in text:
            return text, []
        start = text.index(self.TAG)
        parts = [p.strip() for p in text[start:].split(self.TAG)[1:]]
        calls = []
        for part in parts:
            if not part:
                continue
            if part.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
                array = _json(part, "the [TOOL_CALLS] array")
                if not isinstance(array, list) or not all(isinstance(c, dict) for c in array):
                    raise ToolCallFormatError("[TOOL_CALLS] must be followed by a JSON array of call objects")
                calls += [_call(c.get("name"), c.get("arguments", c.get("parameters", {}))) for c in array]
            else:  # name[ARGS]{...}
                head = self._NAME.match(part)
                if head is None or not head.group(1):
                    raise ToolCallFormatError(f"no function name after [TOOL_CALLS]: {part!r:.80}")
                calls.append(_call(head.group(1), _json(part[head.end() :], f"the arguments of {head.group(1)!r}")))
        if not calls:
            raise ToolCallFormatError("[TOOL_CALLS] with no call after it")
        return _content(text[:start]), calls


class PythonicParser(ToolParser):
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    _LIST_OF_CALLS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")

    def content_end(self, text):
        return _leading(text, (self.START, "["))

    def parse(self, text, tools=None):
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START) :].removesuffix(self.END).strip()
        if not self._LIST_OF_CALLS.match(body):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise ToolCallFormatError(f"not a Python list of calls: {body!r:.120}") from None
        if not isinstance(tree, ast.List):
            raise ToolCallFormatError("the calls must be one Python list")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                raise ToolCallFormatError("each list item must be a call with keyword arguments only")
            try:
                name = ast.unparse(node.func)
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                raise ToolCallFormatError(f"the arguments of a call are not literal values: {body!r:.120}") from None
            if not re.fullmatch(r"[A-Za-z_][\w.]*", name) or len(arguments) != len(node.keywords):
                raise ToolCallFormatError(f"not a plain call: {name!r:.80}")
            calls.append(_call(name, arguments))
        return None, calls


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    _FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def parse(self, text, tools=None):
        starts = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if not starts:
            return text, []
        start = min(starts)
        schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
                   for t in tools or [] if isinstance(t.get("function"), dict)}  # fmt: skip
        calls = []
        for name, body in self._FUNCTION.findall(text[start:]):
            name = name.strip()
            if not name:
                raise ToolCallFormatError("<function=> with no name")
            props = schemas.get(name, {})
            arguments = {}
            for key, value in self._PARAMETER.findall(body):
                key = key.strip()
                value = value.removeprefix("\n").removesuffix("\n")
                arguments[key] = _typed(value, props.get(key) if isinstance(props, dict) else None)
            calls.append(_call(name, arguments))
        if not calls:
            raise ToolCallFormatError("<tool_call> with no <function=...> in it")
        return _content(text[:start]), calls


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as its schema's type (text it does not fit stays text)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return value
    if kind is None:  # no schema: JSON if it reads as JSON
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    if value.strip().lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and re.fullmatch(r"\s*-?\d+\s*", value) else number
        if kind == "boolean":
            lowered = value.strip().lower()
            if lowered in ("true", "false"):
                return lowered == "true"
            return value
        return json.loads(value)  # object, array
    except (ValueError, RecursionError):
        return value


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(),
                                                      PythonicParser(), Qwen3CoderParser(), OpenAIParser())}  # fmt: skip
