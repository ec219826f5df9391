"""Triton Inference Server replicas as upstreams, spoken to over gRPC (tritonclient's asyncio client).

The OpenAI request is turned into a KServe v2 request for the alias's Triton model, and the
answer back into the OpenAI shape:
- chat and completions: a streamed (decoupled) request on the llmserve `chat` model; chat
  messages travel as the `messages` request parameter and the model applies its chat template;
- `/v1/embeddings`: the `embed` model (`text` in, `embedding` out; float or base64 out);
- `/v1/rerank`: the `rerank` model (`query` and `documents` in, `scores` out), results sorted.
Triton models count no tokens, so these answers carry no `usage` (limits keep the reservation).
Cancelling the stream (the client left) cancels the gRPC call: Triton tells the model, which
aborts the request in its engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from pydantic import ValidationError
from tritonclient.utils import InferenceServerException

from llmserve.gateway.opened import Opened, UpstreamFailed
from llmserve.serve.errors import error_body
from llmserve.serve.pooling_protocol import embedding_json, rerank_order
from llmserve.serve.protocol import STRUCTURED_FIELDS, ChatCompletionRequest
from llmserve.serve.tools import NO_TOOLS, AutoToolChoiceUnavailable, ToolPlan, ToolStream, plan_tools

if TYPE_CHECKING:  # annotations only: state.py holds the clients defined here
    from llmserve.gateway.router import Pick
    from llmserve.gateway.state import RequestContext

EMBED_BATCH = 32  # the shipped embed model's max_batch_size
SAMPLING = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int, "ignore_eos": bool}


class BadRequest(Exception):
    """The request cannot be put to a Triton model (400)."""


class TritonClients:
    """One gRPC client per Triton replica address, opened on first use."""

    def __init__(self) -> None:
        self._clients: dict[str, grpcclient.InferenceServerClient] = {}

    def get(self, url: str) -> grpcclient.InferenceServerClient:
        address = url.removeprefix("grpc://")
        if address not in self._clients:
            self._clients[address] = grpcclient.InferenceServerClient(address)
        return self._clients[address]

    async def ready(self, url: str, model: str, timeout: float) -> bool:
        try:
            return bool(await self.get(url).is_model_ready(model, client_timeout=timeout))
        except (InferenceServerException, grpc.RpcError, OSError):
            return False

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


def _strings(name: str, texts: list[str], shape: list[int]) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, shape, "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_).reshape(shape))
    return tensor


def _texts(value, what: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(t, str) for t in items):
        raise BadRequest(f"{what} must be a string or a non-empty list of strings")
    return items


def _unavailable(exc: InferenceServerException) -> bool:
    status = str(exc.status() or "")
    return "UNAVAILABLE" in status or "DEADLINE" in status or "Connect" in str(exc)


def _json(status: int, body: dict) -> Opened:
    async def nothing() -> None:
        return None

    return Opened(status, json.dumps(body).encode(), None, None, nothing)


async def _embeddings(client, ctx: RequestContext, model: str) -> dict:
    texts = _texts(ctx.payload.get("input"), "input")
    rows = []
    for start in range(0, len(texts), EMBED_BATCH):
        part = texts[start:start + EMBED_BATCH]
        result = await client.infer(model, [_strings("text", part, [len(part), 1])])
        rows.extend(result.as_numpy("embedding"))
    b64 = ctx.payload.get("encoding_format") == "base64"
    data = [{"object": "embedding", "index": i, "embedding": embedding_json(v, b64)} for i, v in enumerate(rows)]
    return {"object": "list", "data": data, "model": ctx.alias}


async def _rerank(client, ctx: RequestContext, model: str) -> dict:
    query = ctx.payload.get("query")
    if not isinstance(query, str):
        raise BadRequest("query must be a string")
    docs = [d.get("text") if isinstance(d, dict) else d for d in (ctx.payload.get("documents") or [])]
    docs = _texts(docs, "documents")
    inputs = [_strings("query", [query], [1, 1]), _strings("documents", docs, [1, len(docs)])]
    scores = (await client.infer(model, inputs)).as_numpy("scores")[0]
    top_n = ctx.payload.get("top_n")
    order = rerank_order(scores, top_n if isinstance(top_n, int) and top_n > 0 else None)
    results = [{"index": i, "relevance_score": float(scores[i]), "document": {"text": docs[i]}} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": ctx.alias, "results": results}


def _generation_request(ctx: RequestContext, pick: Pick, model: str) -> dict:
    payload = ctx.payload
    if (payload.get("n") or 1) != 1:
        raise BadRequest("n > 1 is not supported by Triton chat models")
    params: dict = {}
    for name, cast in SAMPLING.items():
        value = payload.get("max_completion_tokens" if name == "max_tokens" and "max_completion_tokens" in payload
                            else name)  # fmt: skip
        if value is not None:
            if isinstance(value, bool) != (cast is bool) or not isinstance(value, int | float):
                raise BadRequest(f"{name} must be a {cast.__name__}")
            params[name] = cast(value)
    stop = payload.get("stop")
    if stop is not None:
        params["stop"] = json.dumps([stop] if isinstance(stop, str) else stop)
    if pick.route.send_priority and ctx.priority:
        params["priority"] = -ctx.priority  # the engine's convention: lower first
    bias = payload.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest("logit_bias must map token ids to biases")
        params["logit_bias"] = json.dumps(bias)
    constraint = {k: payload[k] for k in STRUCTURED_FIELDS if payload.get(k) is not None}
    tools = tool_plan(payload)
    if tools is not None and tools.constraint is not None:  # a named or required tool choice
        constraint = {"structured_outputs": {"json": tools.constraint.json}}
    if constraint:  # structured outputs: the chat model reads them as the API server does
        params["structured_outputs"] = json.dumps(constraint)
    if tools is not None and tools.template_tools:
        params["tools"] = json.dumps(tools.template_tools)
    if "messages" in payload:
        if not isinstance(payload["messages"], list):
            raise BadRequest("messages must be a list")
        params["messages"] = json.dumps(payload["messages"])
        prompt = ""
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("a Triton chat model takes one text prompt")
    return {"model_name": model, "inputs": [_strings("text_input", [prompt], [1])], "parameters": params}


def tool_plan(payload: dict) -> ToolPlan | None:
    """A chat request's tools as the API server plans them (serve/tools.py); "auto", which
    needs a parser of the model's own call format, is not offered by Triton chat models."""
    if "messages" not in payload or (not payload.get("tools") and payload.get("tool_choice") in (None, "none")):
        return None
    try:
        return plan_tools(ChatCompletionRequest.model_validate(payload), parser=None)
    except AutoToolChoiceUnavailable:
        raise BadRequest('tool_choice "auto" (the default with tools) is served by llmserve upstreams started with '
                         '--enable-auto-tool-choice; a Triton chat model takes "required", a named function or "none"') from None
    except ValidationError as exc:
        first = exc.errors()[0]
        raise BadRequest(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}"[:500]) from None
    except ValueError as exc:
        raise BadRequest(str(exc)[:500]) from None


async def _deltas(client, request: dict) -> AsyncIterator[tuple[str, str]]:
    """(new text, finish reason) as the model streams them; cancelled when closed early.

    A finished request's call is left for the server to end, not cancelled: Triton 2.51
    can crash (SIGSEGV) when a cancellation races the completion of a request, a race
    fixed only in later releases (triton-inference-server/server#7840, #8034), and a CI
    run here hit it."""

    async def one_request():
        yield request

    stream = client.stream_infer(one_request())
    ended = False
    try:
        async for result, error in stream:
            if error is not None:
                raise error
            if result.get_response().outputs:
                text = result.as_numpy("text_output")[0].decode()
                finish = result.as_numpy("finish_reason")[0].decode()
                if finish:
                    ended = await _call_ended(stream)
                yield text, finish
                if finish:
                    return
    finally:
        if not ended:  # the client went away mid-stream (or the call would not end): abort it
            stream.cancel()


async def _call_ended(stream, timeout: float = 2.0) -> bool:
    """Wait for the server to end a call whose request has finished (we sent one request,
    and the server ends the call after its final response); False if it did not."""
    try:
        async with asyncio.timeout(timeout):
            async for _ in stream:
                pass
        return True
    except (TimeoutError, grpc.RpcError, InferenceServerException):
        return False


class _Chunks:
    """OpenAI response objects for the text a Triton chat model streams (tool calls cut
    from it as the API server does: `ToolStream`, `ToolPlan.parse`)."""

    def __init__(self, ctx: RequestContext):
        self.chat = "messages" in ctx.payload
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.alias = ctx.alias
        self.tools = tool_plan(ctx.payload) if self.chat else None
        self.message = ToolStream(self.tools)
        self.text = ""

    def chunk(self, text: str | None, finish: str | None, role: bool = False) -> str | None:
        """The event for the next piece of text (None: nothing to send yet)."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""}
            if not role:
                self.text += text or ""
                step = self.message.step(self.text, finish or None)
                if step is None:
                    return None
                content, calls, finish = step
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = [c.model_dump(exclude_none=True) for c in calls]
            choice = {"index": 0, "delta": delta, "finish_reason": finish or None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish or None, "logprobs": None}
            obj = "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.alias, "choices": [choice]}
        return "data: " + json.dumps(body, separators=(",", ":"))

    def whole(self, text: str, finish: str) -> dict:
        if self.chat:
            content, calls, finish = (self.tools or NO_TOOLS).reply(text, finish)
            message = {"role": "assistant", "content": content, "tool_calls": [c.model_dump() for c in calls]}
            choice = {"index": 0, "message": message, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.alias, "choices": [choice]}


async def _generate(client, ctx: RequestContext, pick: Pick, model: str) -> Opened:
    deltas = _deltas(client, _generation_request(ctx, pick, model))
    chunks = _Chunks(ctx)
    try:
        first = await anext(deltas)  # errors before this are retried elsewhere
    except StopAsyncIteration:
        first = ("", "stop")
    except BaseException:
        await deltas.aclose()
        raise
    if not ctx.stream:
        parts, finish = [first[0]], first[1]
        try:
            async for text, reason in deltas:
                parts.append(text)
                finish = reason or finish
        finally:
            await deltas.aclose()
        return _json(200, chunks.whole("".join(parts), finish or "stop"))

    async def lines() -> AsyncIterator[str]:
        if first[0] or first[1]:
            if (line := chunks.chunk(first[0], first[1])) is not None:
                yield line
        async for text, reason in deltas:
            if (line := chunks.chunk(text, reason)) is not None:
                yield line
        yield "data: [DONE]"

    rest = lines()

    async def close() -> None:
        await rest.aclose()
        await deltas.aclose()

    return Opened(200, None, _with_blank_lines(rest), chunks.chunk(None, None, role=True), close)


async def _with_blank_lines(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events are separated by an empty line (the first event went out before these)."""
    async for line in lines:
        yield ""
        yield line
    yield ""


async def open_triton(clients: TritonClients, ctx: RequestContext, pick: Pick) -> Opened:
    model = pick.route.model or pick.alias
    client = clients.get(pick.replica.url)
    try:
        if ctx.path == "/v1/embeddings":
            return _json(200, await _embeddings(client, ctx, model))
        if ctx.path == "/v1/rerank":
            return _json(200, await _rerank(client, ctx, model))
        return await _generate(client, ctx, pick, model)
    except BadRequest as exc:
        return _json(400, error_body(400, str(exc), code="invalid_request"))
    except InferenceServerException as exc:
        if _unavailable(exc):
            raise UpstreamFailed(f"Triton replica {pick.replica.url}: {exc.message()}") from exc
        return _json(400, error_body(400, f"the Triton model refused the request: {exc.message()}",
                                     code="upstream_rejected"))  # fmt: skip
