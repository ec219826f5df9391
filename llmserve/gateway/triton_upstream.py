"""Triton Inference Server replicas as upstreams, spoken to over gRPC (tritonclient's asyncio client).

The OpenAI request is turned into a KServe v2 request for the alias's Triton model, and the
answer back into the OpenAI shape:
- chat and completions: a streamed (decoupled) request on the llmserve `chat` model; chat
  messages travel as the `messages` request parameter and the model applies its chat template;
- `/v1/embeddings`: the `embed` model (`text` in, `embedding` out; float or base64 out);
- `/v1/rerank`: the `rerank` model (`query` and `documents` in, `scores` out), results sorted.
Chat and completions carry `usage` (the chat model counts the tokens as the API server does),
and the limits settle with it; embeddings and rerank carry none (limits keep the reservation).
Cancelling the stream (the client left) cancels the gRPC call: Triton tells the model, which
aborts the request in its engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from llmserve.gateway.opened import Opened, UpstreamFailed
from llmserve.gateway.triton_checks import (
    BadRequest,
    embeddings_call,
    generation_request,
    rerank_call,
    sampling_parameters,
    text_prompt,
)
from llmserve.openai.errors import error_body
from llmserve.openai.pooling_protocol import embedding_json, rerank_order
from llmserve.openai.protocol import STRUCTURED_FIELDS, ChatCompletionRequest
from llmserve.openai.tools import NO_TOOLS, AutoToolChoiceUnavailable, ToolPlan, ToolStream, plan_tools

if TYPE_CHECKING:  # annotations only: state.py holds the clients defined here
    from llmserve.gateway.router import Pick
    from llmserve.gateway.state import RequestContext

EMBED_BATCH = 32  # the shipped embed model's max_batch_size
# the inputs a Triton model must take to serve each endpoint (the llmserve chat, embed, rerank models)
ENDPOINT_INPUTS = {"/v1/chat/completions": frozenset({"text_input"}), "/v1/completions": frozenset({"text_input"}),
                   "/v1/embeddings": frozenset({"text"}), "/v1/rerank": frozenset({"query", "documents"})}
CLIENT_ERROR_MARK = "invalid request: "  # how the chat model marks the errors that are the request's fault


class TritonClients:
    """One gRPC client per Triton replica address, opened on first use; `timeout` bounds each
    call, and the wait for each next response of a stream."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self._clients: dict[str, grpcclient.InferenceServerClient] = {}
        self._inputs: dict[tuple[str, str], tuple[float, frozenset[str]]] = {}

    def get(self, url: str) -> grpcclient.InferenceServerClient:
        address = url.removeprefix("grpc://")
        if address not in self._clients:
            self._clients[address] = grpcclient.InferenceServerClient(address)
        return self._clients[address]

    async def inputs(self, url: str, model: str) -> frozenset[str]:
        """The names of a model's inputs (its metadata, kept for a minute: a model may be
        reloaded as another kind)."""
        key, now = (url, model), time.monotonic()
        cached = self._inputs.get(key)
        if cached is None or now - cached[0] > 60.0:
            meta = await self.get(url).get_model_metadata(model, as_json=True, client_timeout=self.timeout)
            cached = self._inputs[key] = (now, frozenset(i["name"] for i in meta.get("inputs", [])))
        return cached[1]

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


def _message(exc: InferenceServerException) -> str:
    """Triton's message without the Python backend's traceback ("At: /path/model.py(17)...")."""
    return (exc.message() or str(exc)).split("\n\nAt:\n")[0].strip()


def _client_fault(exc: InferenceServerException) -> bool:
    """The model refused the request itself (a 400), as opposed to failing (a 5xx: retried on
    another replica). Unary calls carry a gRPC status; a stream's errors carry only a message,
    which the llmserve chat model starts with CLIENT_ERROR_MARK for the request's faults."""
    status = str(exc.status() or "")
    if status:  # a bad value; a call this model does not take (an embedding call to a chat model)
        return any(name in status for name in ("INVALID_ARG", "UNIMPLEMENTED", "OUT_OF_RANGE"))
    return _message(exc).startswith(CLIENT_ERROR_MARK)


def _json(status: int, body: dict) -> Opened:
    async def nothing() -> None:
        return None

    return Opened(status, json.dumps(body).encode(), None, None, nothing)


async def _embeddings(clients: TritonClients, client, ctx: RequestContext, model: str) -> dict:
    call = embeddings_call(ctx.payload)
    rows = []
    for start in range(0, len(call.texts), EMBED_BATCH):
        part = call.texts[start:start + EMBED_BATCH]
        result = await client.infer(model, [_strings("text", part, [len(part), 1])], client_timeout=clients.timeout)
        rows.extend(result.as_numpy("embedding"))
    if call.dimensions is not None and rows and call.dimensions != len(rows[0]):
        raise BadRequest(f"this model's embeddings have {len(rows[0])} dimensions; `dimensions` cannot change "
                         f"that (got {call.dimensions})")  # fmt: skip
    data = [{"object": "embedding", "index": i, "embedding": embedding_json(v, call.base64)}
            for i, v in enumerate(rows)]  # fmt: skip
    return {"object": "list", "data": data, "model": ctx.alias}


async def _rerank(clients: TritonClients, client, ctx: RequestContext, model: str) -> dict:
    call = rerank_call(ctx.payload)
    docs = call.documents
    inputs = [_strings("query", [call.query], [1, 1]), _strings("documents", docs, [1, len(docs)])]
    scores = (await client.infer(model, inputs, client_timeout=clients.timeout)).as_numpy("scores")[0]
    results = []
    for i in rerank_order(scores, call.top_n):
        result = {"index": i, "relevance_score": float(scores[i])}
        if call.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": ctx.alias, "results": results}


def _generation_request(ctx: RequestContext, pick: Pick, model: str) -> tuple[dict, ToolPlan | None]:
    """The KServe request for a chat or completions call, and the chat's tool plan."""
    chat = ctx.path == "/v1/chat/completions"
    req = generation_request(ctx.payload, chat)
    params = sampling_parameters(req)
    if req.stop is not None:
        params["stop"] = json.dumps([req.stop] if isinstance(req.stop, str) else req.stop)
    if req.logit_bias is not None:
        params["logit_bias"] = json.dumps(req.logit_bias)
    constraint = {k: getattr(req, k) for k in STRUCTURED_FIELDS if getattr(req, k) is not None}
    tools = tool_plan(req) if chat else None
    if tools is not None and tools.constraint is not None:  # a named or required tool choice
        constraint = {"structured_outputs": {"json": tools.constraint.json}}
    if constraint:  # structured outputs: the chat model reads them as the API server does
        params["structured_outputs"] = json.dumps(constraint)
    if tools is not None and tools.template_tools:
        params["tools"] = json.dumps(tools.template_tools)
    inputs = []
    if chat:
        params["messages"] = json.dumps(ctx.payload["messages"])
        prompt = ""
    else:
        prompt = text_prompt(req)
    inputs.append(_strings("text_input", [prompt], [1]))
    if pick.route.send_priority and ctx.priority:
        # an input tensor, not a request parameter: tritonclient reserves the parameter name
        priority = grpcclient.InferInput("priority", [1], "INT32")
        value = min(max(-ctx.priority, -(1 << 31)), (1 << 31) - 1)  # the engine's way: lower first; int32
        priority.set_data_from_numpy(np.array([value], dtype=np.int32))
        inputs.append(priority)
    return {"model_name": model, "inputs": inputs, "parameters": params}, tools


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """A chat request's tools as the API server plans them (serve/tools.py); "auto", which
    needs a parser of the model's own call format, is not offered by Triton chat models."""
    if not req.tools and req.tool_choice in (None, "none"):
        return None
    try:
        return plan_tools(req, parser=None)
    except AutoToolChoiceUnavailable:
        raise BadRequest('tool_choice "auto" (the default with tools) is served by llmserve upstreams started with '
                         '--enable-auto-tool-choice; a Triton chat model takes "required", a named function or "none"') from None
    except ValueError as exc:
        raise BadRequest(str(exc)[:500]) from None


@dataclass
class Delta:
    text: str
    finish: str
    prompt_tokens: int | None  # None: a chat model that does not count (an older config)
    completion_tokens: int | None


def _count(result, name: str) -> int | None:
    array = result.as_numpy(name)
    return None if array is None else int(array.reshape(-1)[0])


async def _deltas(client, request: dict, timeout: float) -> AsyncIterator[Delta]:
    """The new text, finish reason and token counts as the model streams them; cancelled when closed early;
    TimeoutError when the next response takes over `timeout` seconds (a model that died).

    A finished request's call is left for the server to end, not cancelled: Triton 2.51
    can crash (SIGSEGV) when a cancellation races the completion of a request, a race
    fixed only in later releases (triton-inference-server/server#7840, #8034), and a CI
    run here hit it."""

    async def one_request():
        yield request

    stream = client.stream_infer(one_request())
    ended = False
    try:
        while True:
            try:
                async with asyncio.timeout(timeout):
                    result, error = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise TimeoutError(f"no response from the Triton model within {timeout:g} s") from None
            if error is not None:
                raise error
            if result.get_response().outputs:
                text = result.as_numpy("text_output")[0].decode()
                finish = result.as_numpy("finish_reason")[0].decode()
                if finish:
                    ended = await _call_ended(stream)
                yield Delta(text, finish, _count(result, "prompt_tokens"), _count(result, "completion_tokens"))
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

    def __init__(self, ctx: RequestContext, tools: ToolPlan | None):
        self.chat = ctx.path == "/v1/chat/completions"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.alias = ctx.alias
        self.tools = tools
        self.message = ToolStream(self.tools)
        self.text = ""
        self.ctx = ctx
        self.usage: dict | None = None
        options = ctx.payload.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True

    def count(self, delta: Delta) -> None:
        """The request's usage so far."""
        if delta.prompt_tokens is not None and delta.completion_tokens is not None:
            self.usage = {"prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
                          "total_tokens": delta.prompt_tokens + delta.completion_tokens}  # fmt: skip

    def settle(self) -> None:
        """The limits settle with the tokens counted, whether or not the client asked to see them."""
        if self.usage is not None:
            self.ctx.used_tokens = self.usage["total_tokens"]

    def usage_chunk(self) -> str | None:
        """The last event of a stream whose client asked for usage (OpenAI: no choices, the usage)."""
        if not self.include_usage or self.usage is None:
            return None
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.alias, "choices": [],
                "usage": self.usage}  # fmt: skip
        return "data: " + json.dumps(body, separators=(",", ":"))

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
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.alias, "choices": [choice]}
        if self.usage is not None:
            body["usage"] = self.usage
        return body


async def _generate(clients: TritonClients, client, ctx: RequestContext, pick: Pick, model: str) -> Opened:
    request, tools = _generation_request(ctx, pick, model)
    deltas = _deltas(client, request, clients.timeout)
    chunks = _Chunks(ctx, tools)
    try:
        first = await anext(deltas)  # errors before this are retried elsewhere
    except StopAsyncIteration:
        first = Delta("", "stop", None, None)
    except BaseException:
        await deltas.aclose()
        raise
    chunks.count(first)
    if not ctx.stream:
        parts, finish = [first.text], first.finish
        try:
            async for delta in deltas:
                parts.append(delta.text)
                finish = delta.finish or finish
                chunks.count(delta)
        finally:
            await deltas.aclose()
        return _json(200, chunks.whole("".join(parts), finish or "stop"))

    async def lines() -> AsyncIterator[str]:
        if first.text or first.finish:
            if (line := chunks.chunk(first.text, first.finish)) is not None:
                yield line
        try:
            async for delta in deltas:
                chunks.count(delta)
                if (line := chunks.chunk(delta.text, delta.finish)) is not None:
                    yield line
            if (line := chunks.usage_chunk()) is not None:
                yield line
            yield "data: [DONE]"
        finally:  # also when the client left: what was generated until then
            chunks.settle()

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
        needed = ENDPOINT_INPUTS.get(ctx.path, ENDPOINT_INPUTS["/v1/completions"])
        if not needed <= await clients.inputs(pick.replica.url, model):  # e.g. a chat call to the embed model
            raise BadRequest(f"the model {ctx.alias!r} does not serve {ctx.path} (a Triton model taking "
                             f"{', '.join(sorted(needed))} does)")  # fmt: skip
        if ctx.path == "/v1/embeddings":
            return _json(200, await _embeddings(clients, client, ctx, model))
        if ctx.path == "/v1/rerank":
            return _json(200, await _rerank(clients, client, ctx, model))
        return await _generate(clients, client, ctx, pick, model)
    except BadRequest as exc:
        return _json(400, error_body(400, str(exc), code="invalid_request"))
    except InferenceServerException as exc:
        message = _message(exc).removeprefix(CLIENT_ERROR_MARK)
        if _client_fault(exc):
            return _json(400, error_body(400, f"the Triton model refused the request: {message}",
                                         code="upstream_rejected"))  # fmt: skip
        if "RESOURCE_EXHAUSTED" in str(exc.status() or ""):  # its queue is full: busy, not broken
            raise _failed(pick, 503, f"the Triton model is overloaded: {message}", "upstream_overloaded") from exc
        # the model or server failed (unreachable, a dead backend stub, a crash): another
        # replica may answer; the breaker counts it
        raise _failed(pick, 502, f"the Triton model failed: {message}", "upstream_failed") from exc
    except grpc.RpcError as exc:  # the call itself broke (Triton went away mid-call)
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        why = code.name if code is not None else type(exc).__name__
        raise _failed(pick, 502, f"the Triton call failed: {why}", "upstream_failed") from exc
    except TimeoutError as exc:
        message = f"the Triton model did not answer within {clients.timeout:g} s"
        raise _failed(pick, 504, message, "upstream_timeout") from exc


def _failed(pick: Pick, status: int, message: str, code: str) -> UpstreamFailed:
    """A replica's failure: another replica is tried; if none answers, the client gets this
    status and message (a 503 is busy, not broken: no breaker count)."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    return UpstreamFailed(f"Triton replica {pick.replica.url}: {message}", status, body, overloaded=status == 503)
