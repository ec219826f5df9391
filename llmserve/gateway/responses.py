"""OpenAI's Responses API on the gateway, over its chat routes: POST /v1/responses (a body, typed
events, or a background run), GET and DELETE /v1/responses/{id}, GET .../input_items, POST
.../cancel.

The gateway serves it itself with llmserve/responses (the code `llmserve serve` runs), its
`Runner` being the gateway's own chat path: a response's chat request (its whole conversation,
rebuilt from the store for `previous_response_id`) goes through the same checks as a
/v1/chat/completions request of the key — its limits (the tokens reserved, then settled with
the usage, reasoning tokens included), admission, the route's replicas, retries and fallback —
as a stream, whose reasoning, content and tool-call deltas become the response's items. So it
works over every chat upstream (llmserve servers, Triton chat models, any OpenAI-compatible
server), and `llmserve up` has it too.

Stored responses live at the gateway (`responses:` in its config), one namespace per key (its
name; an open gateway has one): a key never reads another key's responses, and a chain may
run on any replica, as none of them holds the state.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from llmserve.gateway.config import ApiKey
from llmserve.gateway.context import log_access
from llmserve.gateway.disconnect import ClientLeft
from llmserve.gateway.gateway import Gateway
from llmserve.gateway.intake import (
    Rejected,
    admit_payload,
    caller,
    parse_body,
    read_body,
    reject_response,
    requested_model,
    take_slot,
    wait_for_model,
)
from llmserve.gateway.proxy import NoUpstream, forward
from llmserve.openai.errors import APIError, validation_message
from llmserve.openai.protocol import ChatCompletionRequest, DeltaToolCall
from llmserve.responses.items import ResponsesRequest
from llmserve.responses.service import ChatRun, Ended, Piece, Runner, response_usage

CHAT = "/v1/chat/completions"


def namespace_of(key: ApiKey | None) -> str:
    """Whose stored responses a request reads: its key's (by name), or the open gateway's."""
    return "" if key is None else f"key:{key.name}"


def gateway_runner(gateway: Gateway, request: Request, key: ApiKey | None, alias: str, request_id: str) -> Runner:
    """A response's chat request sent as `key`'s /v1/chat/completions request to `alias`, streamed."""

    async def run(chat: ChatCompletionRequest, rid: str) -> ChatRun:
        payload = chat.model_dump(exclude_unset=True, exclude_none=True)
        payload.update(model=alias, stream=True, stream_options={"include_usage": True})
        ctx = await admit_payload(gateway, key, payload, CHAT, request_id)
        try:
            await take_slot(gateway, ctx, request)
            await wait_for_model(gateway, ctx, request)
        except Rejected:
            raise
        except BaseException:  # the client left while it waited
            await gateway.finish(ctx, 499)
            raise
        try:
            answer = await forward(gateway, ctx)
        except NoUpstream:
            await gateway.finish(ctx, 503)
            raise Rejected(503, "no_healthy_upstream", f"no replica of {alias!r} can take the request", 1) from None
        except BaseException:
            gateway.release(ctx)
            raise
        if not isinstance(answer, StreamingResponse):  # refused upstream (finished already)
            raise _upstream_error(answer)
        return ChatRun(_pieces(answer.body_iterator))

    return run


def _upstream_error(answer: Response) -> APIError:
    """The upstream's refusal of the chat request, as the response's."""
    try:
        error = json.loads(answer.body)["error"]
        return APIError(answer.status_code, str(error["message"]), error.get("code"), error.get("param"))
    except (ValueError, KeyError, TypeError):
        return APIError(answer.status_code, f"the upstream answered {answer.status_code}", "upstream_failed")


async def _pieces(events: AsyncIterator[str | bytes]) -> AsyncIterator[Piece | Ended]:
    """A chat completions stream's chunks as the pieces of a response: reasoning deltas (vLLM's
    `reasoning`, or `reasoning_content`), content, tool call deltas; at [DONE], its end with the
    usage chunk's counts."""
    finish, usage, buffer = None, None, ""
    async with aclosing(events):
        async for text in events:
            buffer += text.decode() if isinstance(text, bytes) else text
            *lines, buffer = buffer.split("\n")
            for line in lines:
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    yield Ended(finish == "length", _usage(usage))
                    return
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:  # the upstream failed mid-stream
                    error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                    raise APIError(
                        502, str(error.get("message", chunk["error"])), error.get("code") or "upstream_failed"
                    )
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    calls = [DeltaToolCall.model_validate(call) for call in delta.get("tool_calls") or []]
                    thought = delta.get("reasoning") or delta.get("reasoning_content") or ""
                    if thought or delta.get("content") or calls:
                        yield Piece(thought, delta.get("content") or "", calls)
                    finish = choice.get("finish_reason") or finish
    raise APIError(502, "the upstream's stream ended without [DONE]", "upstream_failed")


def _usage(usage: dict | None) -> dict:
    """Chat usage as the Responses API's."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    thoughts = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return response_usage(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0, thoughts, cached)


def responses_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()
    service = gateway.responses
    config = gateway.config

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
            key = caller(gateway, request)
            payload = parse_body(body)
            alias = requested_model(gateway, key, payload)
            try:
                req = ResponsesRequest.model_validate(payload)
            except ValidationError as exc:
                message, param = validation_message(exc.errors(include_url=False))
                raise APIError(400, message, param=param) from None
            runner = gateway_runner(gateway, request, key, alias, request_id)
            reply = await service.create(req, alias, namespace_of(key), runner)
        except Rejected as exc:
            gateway.metrics.rejections.labels(exc.reason).inc()
            log_access(request_id, exc.status, rejected=exc.reason)
            return reject_response(exc, request_id)
        except ClientLeft:  # while its chat request waited for a slot
            return Response(status_code=499)
        headers = {"x-request-id": request_id}
        if reply.events is not None:
            return StreamingResponse(reply.events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await reply.body, headers=headers)

    def whose(request: Request) -> str:
        return namespace_of(caller(gateway, request))

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> dict:
        return await service.retrieve(whose(request), response_id)

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict:
        return await service.delete(whose(request), response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> dict:
        return await service.cancel(whose(request), response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, after: str | None = None, limit: int = 20,
                          order: str = "desc") -> dict:  # fmt: skip
        return await service.input_items(whose(request), response_id, after, limit, order)

    return router
