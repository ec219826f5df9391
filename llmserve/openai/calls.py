"""One OpenAI call from its raw JSON: what a caller without a web framework (the Triton chat
model) hands over. The body is read as `llmserve serve` reads it (strict JSON, valid Unicode,
the same schemas), then chat or completions runs; anything wrong is a `Reply` carrying the
OpenAI error and its status, never an exception."""

from __future__ import annotations

import json

from pydantic import ValidationError

from llmserve.engine.protocol import EngineClient
from llmserve.errors import EngineDeadError
from llmserve.lora_request import LoRARequest
from llmserve.openai.chat import chat_completion
from llmserve.openai.completions import completion
from llmserve.openai.deadline import effective_timeout, with_deadline
from llmserve.openai.errors import APIError, engine_dead, validation_message
from llmserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.openai.reply import Reply
from llmserve.openai.text_checks import LONE_SURROGATE, has_lone_surrogate

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def read_request(endpoint: str, body: bytes) -> ChatCompletionRequest | CompletionRequest:
    """The request `body` holds for `endpoint`; APIError (400/404) when it cannot be read."""
    if endpoint not in ENDPOINTS:
        raise APIError(404, f"no endpoint {endpoint!r} here (served: {', '.join(ENDPOINTS)})")
    try:
        payload = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise APIError(
            400, "the request body is not valid JSON (or is nested too deeply)", code="invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    if has_lone_surrogate(body, payload):
        raise APIError(400, LONE_SURROGATE)
    schema = ChatCompletionRequest if endpoint == CHAT else CompletionRequest
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        raise APIError(400, message, param=param) from None


async def openai_call(engine: EngineClient, endpoint: str, body: bytes, model: str,
                      tool_call_parser: str | None = None, adapters: dict[str, LoRARequest] | None = None,
                      request_timeout_s: float | None = None, reasoning_parser: str | None = None) -> Reply:  # fmt: skip
    """Run the OpenAI request `body` for `endpoint` on `engine`; `model` names the answers. A
    body whose "model" is one of `adapters` runs with that LoRA adapter (and is named by it).
    `request_timeout_s` caps every request's time (openai/deadline.py); `reasoning_parser`
    (llmserve.reasoning) puts a chat reply's thoughts apart from its content."""
    try:
        req = read_request(endpoint, body)
        lora = (adapters or {}).get(req.model) if req.model else None
        if lora is not None:
            model = req.model
        if endpoint == CHAT:
            reply = await chat_completion(engine, req, model, tool_call_parser, lora, reasoning_parser)
        else:
            reply = await completion(engine, req, model, lora)
        return with_deadline(reply, effective_timeout(req.request_timeout_s, request_timeout_s))
    except APIError as exc:
        return Reply.refused(exc)
    except EngineDeadError as exc:
        return Reply.refused(engine_dead(exc))
    except ValueError as exc:  # sampling settings the engine refuses
        return Reply.refused(APIError(400, str(exc)))
