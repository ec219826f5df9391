"""The Responses API's request and its items: a request read (every field a 400 naming it when
wrong), its input items written out in one stored shape, and a list of items turned into the chat
request that runs it (llmserve/openai/chat.py does the rest: template, sampling, tools, grammar).

Items, as OpenAI's types (openai.types.responses) spell them:
- `message`: role user/system/developer/assistant, content a string or parts (`input_text`,
  `output_text`; images, files and audio are refused: this server runs text models);
- `function_call` (an assistant's call: call_id, name, arguments) and `function_call_output`
  (its result: call_id, output);
- `reasoning` (a reasoning model's thoughts): kept in the conversation, not shown to the chat
  template again (the templates of R1 and Qwen3 drop earlier turns' thoughts themselves).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, ValidationError

from llmserve.openai.errors import APIError, validation_message
from llmserve.openai.protocol import ChatCompletionRequest, OpenAIModel, _SamplingFields

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# request fields passed on to the chat request as they are (vLLM's and llmserve's sampling
# extensions: top_k, seed, stop, guided_*, structured_outputs, chat_template_kwargs...)
PASSED_ON = (set(_SamplingFields.model_fields) | {"chat_template_kwargs"}) - {
    "model", "n", "stream", "stream_options", "response_format", "temperature", "top_p", "return_token_ids",
}  # fmt: skip


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: `resp_...`, `msg_...`, `fc_...`."""
    import uuid

    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses. Unknown fields of OpenAI's that change nothing here are accepted."""

    model: str | None = None
    input: Any = Field(default_factory=list)  # a string or a list of items: read by normalize_items
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # effort and summary: the model thinks as it does
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    store: bool = True
    background: bool = False
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    request_timeout_s: float | None = Field(default=None, ge=1)
    return_token_ids: bool = False  # llmserve's: the prompt's token ids in the response (`prompt_token_ids`)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _objects(value: Any, where: str, what: str) -> Iterator[tuple[str, dict]]:
    """Each object of the list `value` with where it stands (`input[3]`)."""
    if not isinstance(value, list):
        raise _bad(where, f"must be a string or a list of {what}")
    for j, obj in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(obj, dict):
            raise _bad(at, "must be an object")
        yield at, obj


def _text_of(parts: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A content given as a string or as text parts (of `kinds`), as one text."""
    if isinstance(parts, str):
        return parts
    texts = []
    for at, part in _objects(parts, where, "content parts"):
        kind = part.get("type")
        if kind not in kinds:
            raise _bad(f"{at}.type", f"must be one of {', '.join(kinds)} (this server takes text only); got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{at}.text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}", "is required and must be a string")
    return value


def normalize_items(raw: Any, where: str = "input") -> list[dict]:
    """The request's input as stored items, each with an id and a status (APIError 400 naming the
    field for one that is not an item this server takes)."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    items = []
    for at, item in _objects(raw, where, "items"):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _bad(f"{at}.role", f"must be one of {', '.join(MESSAGE_ROLES)}; got {role!r}")
            if role == "assistant":
                text = _text_of(item.get("content"), f"{at}.content", ("output_text", "input_text", "refusal_text"))
                part = {"type": "output_text", "text": text, "annotations": []}
            else:
                part = {"type": "input_text", "text": _text_of(item.get("content"), f"{at}.content", ("input_text",))}
            items.append({"id": item.get("id") or new_id("msg"), "type": "message", "role": role,
                          "content": [part], "status": "completed"})  # fmt: skip
        elif kind == "function_call":
            arguments = _string(item, "arguments", at)
            items.append({"id": item.get("id") or new_id("fc"), "type": "function_call",
                          "call_id": _string(item, "call_id", at), "name": _string(item, "name", at),
                          "arguments": arguments, "status": "completed"})  # fmt: skip
        elif kind == "function_call_output":
            output = _text_of(item.get("output"), f"{at}.output", ("input_text", "output_text"))
            items.append({"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                          "call_id": _string(item, "call_id", at), "output": output, "status": "completed"})  # fmt: skip
        elif kind == "reasoning":
            thoughts = item.get("content") or []
            text = _text_of(thoughts, f"{at}.content", ("reasoning_text",))
            summary = item.get("summary") or []
            _text_of(summary, f"{at}.summary", ("summary_text",))
            items.append({"id": item.get("id") or new_id("rs"), "type": "reasoning", "summary": summary,
                          "content": [{"type": "reasoning_text", "text": text}] if thoughts else None,
                          "status": "completed"})  # fmt: skip
        else:
            raise _bad(f"{at}.type", "must be message, function_call, function_call_output or reasoning "
                                     f"(other item types are not served here); got {kind!r}")  # fmt: skip
    return items


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """The conversation of `items` as chat messages: the instructions as the system message first,
    an assistant's function calls as its message's tool calls, their outputs as tool messages;
    reasoning items left out."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"][0]["text"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one turn go with its text
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _chat_tools(tools: list[Any] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools[{i}].type", f"only function tools are served here; got {kind!r}")
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}].name", "is required and must be a string")
        fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fields})
    return out


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise _bad("tool_choice", f"must be none, auto, required or a function; got {choice!r}")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _bad("tool_choice", 'a named choice is {"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema", "is required and must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]}}
    raise _bad("text.format.type", f"must be text, json_object or json_schema; got {kind!r}")


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completions request that runs `req` over the conversation `messages`."""
    if not any(m["role"] != "system" for m in messages):
        raise _bad("input", "give at least one input item (or a previous_response_id)")
    fields: dict[str, Any] = {k: v for k, v in (req.model_extra or {}).items() if k in PASSED_ON}
    fields.update(messages=messages, tools=_chat_tools(req.tools), tool_choice=_chat_tool_choice(req.tool_choice),
                  parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
                  max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p)  # fmt: skip
    if req.tools is None:
        fields.pop("tools")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        raise APIError(400, message, param=param) from None
