"""What a request passes before it goes upstream, in order: its body (size, time, strict
JSON), its key, its model, its limits (`admit`), then an admission slot (`take_slot`) and, for
a placed model, its wake (`wait_for_model`). A refusal is a `Rejected`, answered by
`reject_response` in OpenAI's error format.
"""

from __future__ import annotations

import json
import math

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse

from llmserve.gateway.admission import Refused
from llmserve.gateway.affinity import prefix_key
from llmserve.gateway.config import ApiKey
from llmserve.gateway.context import RequestContext
from llmserve.gateway.disconnect import unless_client_leaves
from llmserve.gateway.gateway import Gateway
from llmserve.gateway.keys import may_call
from llmserve.gateway.limits import LimitExceeded, LimitsUnavailable, OverCapacity
from llmserve.gateway.placement import WakeTimeout
from llmserve.openai.errors import error_body
from llmserve.openai.text_checks import LONE_SURROGATE, has_lone_surrogate

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class Rejected(Exception):
    """A request refused before it reaches any upstream."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after


def reject_response(exc: Rejected, request_id: str) -> JSONResponse:
    headers = {"x-request-id": request_id}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))  # whole seconds, never 0
    return JSONResponse(error_body(exc.status, exc.message, code=exc.reason), status_code=exc.status, headers=headers)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Rejected(413, "body_too_large", f"the request body is over {limit} bytes")
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):  # a client trickling its body would hold a slot forever
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise Rejected(413, "body_too_large", f"the request body is over {limit} bytes")
    except TimeoutError:
        raise Rejected(408, "body_timeout", f"the request body did not arrive within {timeout_s} s") from None
    return bytes(body)


def _estimate_tokens(payload: dict, path: str, default_max_tokens: int) -> int:
    """Reserved up front: about 4 characters a prompt token, plus the most the reply may use."""
    fields = ("messages", "prompt", "input", "query", "documents")
    prompt = len(json.dumps([payload.get(f) for f in fields if f in payload])) // 4 + 1
    if path not in GENERATION_PATHS:
        return prompt  # embeddings and rerank generate nothing
    max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or default_max_tokens
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise Rejected(400, "invalid_request", "max_tokens must be a positive integer")
    return prompt + max_tokens


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_body(body: bytes) -> dict:
    """The request's JSON object: strict JSON (no NaN or Infinity), nested within reason, and
    text that is valid Unicode (JSON may escape a lone surrogate, which no UTF-8 can carry)."""
    try:
        payload = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise Rejected(400, "invalid_json", "the request body is not valid JSON (or is nested too deeply)") from None
    if not isinstance(payload, dict):
        raise Rejected(400, "invalid_json", "the request body must be a JSON object")
    if has_lone_surrogate(body, payload):
        raise Rejected(400, "invalid_json", LONE_SURROGATE)
    return payload


def caller(gateway: Gateway, request: Request) -> ApiKey | None:
    """The calling key (None: an open gateway); Rejected 401 for a missing, wrong or revoked one."""
    if gateway.keys.open:
        return None
    key = gateway.keys.authenticate(request.headers.get("authorization"))
    if key is None:
        raise Rejected(401, "invalid_api_key", "missing, wrong or revoked API key")
    return key


async def admit(gateway: Gateway, request: Request, body: bytes, path: str, request_id: str) -> RequestContext:
    return await admit_payload(gateway, caller(gateway, request), parse_body(body), path, request_id)


def requested_model(gateway: Gateway, key: ApiKey | None, payload: dict) -> str:
    """The alias the request names, which `key` may call; Rejected (400, 404, 403) otherwise."""
    alias = payload.get("model")
    if not isinstance(alias, str):
        raise Rejected(400, "invalid_request", "model is required: the name of a model (a string), see /v1/models")
    if alias not in gateway.config.models:
        raise Rejected(404, "model_not_found", f"the model {alias[:100]!r} does not exist")
    if key is not None and not may_call(key, alias):
        raise Rejected(403, "model_not_allowed", f"this key may not call {alias!r}")
    return alias


async def admit_payload(gateway: Gateway, key: ApiKey | None, payload: dict, path: str,
                        request_id: str) -> RequestContext:  # fmt: skip
    """A request of `key` (its JSON `payload`, for `path`) checked and its tokens reserved."""
    alias = requested_model(gateway, key, payload)
    ctx = RequestContext(request_id, path, alias, payload, payload.get("stream") is True, key)
    ctx.reserved_tokens = _estimate_tokens(payload, path, gateway.config.default_max_tokens)
    if gateway.router.uses_affinity and path in GENERATION_PATHS:
        ctx.prefix = prefix_key(payload, gateway.config.models[alias].affinity_prefix_chars)
    if gateway.kv is not None and path in GENERATION_PATHS:
        ctx.kv_prompt = await gateway.kv.prompt(alias, payload, path)
    if key is not None:
        try:
            await gateway.limiter.reserve(key.name, ctx.reserved_tokens)
        except OverCapacity as exc:
            raise Rejected(400, "over_token_limit", f"this request may take {exc.asked} tokens (its input and "
                           f"max_tokens), more than this key's {exc.reason} ({exc.capacity}): it can never be "
                           "admitted; lower max_tokens or send less") from None  # fmt: skip
        except LimitExceeded as exc:
            raise Rejected(429, exc.reason, f"rate limit reached ({exc.reason})", exc.retry_after) from None
        except LimitsUnavailable:
            raise Rejected(503, "limits_unavailable", "the shared rate-limit store cannot be reached", 1) from None
    return ctx


async def take_slot(gateway: Gateway, ctx: RequestContext, request: Request) -> None:
    """Wait for an admission slot; refused (shed or timed out), or the client left while it
    waited: the reservation comes back (and the queue place at once)."""
    acquire = gateway.admission.acquire(ctx.priority, ctx.alias)
    try:
        if gateway.admission.would_wait():  # only a wait needs watching for a client leaving
            ctx.slot = await unless_client_leaves(acquire, request)
        else:
            ctx.slot = await acquire
    except Refused as exc:
        await gateway.give_back(ctx)
        raise Rejected(
            503, exc.reason, f"the gateway is overloaded ({exc.reason}): retry later", exc.retry_after
        ) from None


async def wait_for_model(gateway: Gateway, ctx: RequestContext, request: Request) -> None:
    """A placed model (several on one GPU) asleep: wait for its wake, bounded; then 503
    model_waking with a Retry-After (the slot and the reservation come back)."""
    placement = gateway.placement
    if placement is None or ctx.path not in GENERATION_PATHS or not placement.manages(ctx.alias):
        return
    try:
        if placement.resident(ctx.alias):  # the common case: nothing to wait for or watch
            ctx.placed = await placement.acquire(ctx.alias)
        else:
            ctx.placed = await unless_client_leaves(placement.acquire(ctx.alias), request)
    except WakeTimeout as exc:
        await gateway.give_back(ctx)
        raise Rejected(503, "model_waking", f"{exc}: it is waking, retry later", exc.retry_after_s) from None
