"""Triton Inference Server replicas as upstreams, spoken to over gRPC (`grpc://`, tritonclient's
asyncio client) or HTTP (`http://`, KServe v2 and the generate extension: triton_http.py; what
`llmserve up` uses, as it costs the gateway half as much a streamed token).

- chat and completions: the OpenAI request body itself goes to the llmserve `chat` model
  (`request`, with its `endpoint`), which answers what `llmserve serve` answers, made by the
  same code (llmserve/openai/): the body, or server-sent events (one or more a response). The gateway
  forwards those bytes; it reads no request field but `stream`, and sets `priority` (the
  key's) and asks streams for their usage, so that the limits settle with the real counts
  (the usage chunk is dropped again when the client did not ask for it);
- `/v1/embeddings`: the `embed` model (`text`, or `token_ids` for token-id input, in;
  `embedding` out; float or base64 out);
- `/v1/rerank`: the `rerank` model (`query` and `documents` in, `scores` out), results sorted.
Embeddings and rerank carry the usage `llmserve serve --task embed` gives, from the models'
`tokens` output (the limits settle with it, as with chat's). Cancelling the stream
(the client left) cancels the call: Triton tells the model, which aborts the request
in its engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from types import MappingProxyType

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from llmserve.gateway.context import RequestContext
from llmserve.gateway.opened import Opened, UpstreamFailed
from llmserve.gateway.router import Pick
from llmserve.gateway.triton_checks import BadRequest, embeddings_call, rerank_call
from llmserve.gateway.triton_http import CallBroken, TritonHttp
from llmserve.openai.errors import error_body
from llmserve.openai.pooling_protocol import PoolingUsage, embedding_json, rerank_order
from llmserve.openai.sse_events import KEEPALIVE, split_events

EMBED_BATCH = 32  # the shipped embed model's max_batch_size
# how long a chat call may go without a write before the model sends a keep-alive: Triton's HTTP
# server notices a closed connection (a client that left) only when it writes to it, and the
# chat model then aborts the request (llmserve/triton/inflight.py)
KEEPALIVE_S = 0.5
# the inputs a Triton model must take to serve each endpoint (the llmserve chat, embed, rerank models)
ENDPOINT_INPUTS = MappingProxyType({
    "/v1/chat/completions": frozenset({"request"}), "/v1/completions": frozenset({"request"}),
    "/v1/embeddings": frozenset({"text"}), "/v1/rerank": frozenset({"query", "documents"}),
})  # fmt: skip


class TritonClients:
    """How the gateway speaks to Triton replicas: over gRPC (`grpc://host:port`, one
    tritonclient asyncio client per address, opened on first use) or over HTTP (`http://host:port`,
    one aiohttp session: triton_http.py); `timeout` bounds each call, and the wait for each
    next response of a stream."""

    def __init__(self, timeout: float = 600.0, request_timeout_s: float | None = None) -> None:
        self.timeout = timeout
        self.request_timeout_s = request_timeout_s  # sent with each chat request (its deadline there)
        self._clients: dict[str, grpcclient.InferenceServerClient] = {}
        self.http = TritonHttp(timeout)
        self._inputs: dict[tuple[str, str], tuple[float, frozenset[str]]] = {}
        self._backends: dict[tuple[str, str], Backend] = {}

    def get(self, url: str) -> grpcclient.InferenceServerClient:
        address = url.removeprefix("grpc://")
        if address not in self._clients:
            self._clients[address] = grpcclient.InferenceServerClient(address)
        return self._clients[address]

    def backend(self, url: str, model: str) -> Backend:
        """How the gateway knows `model` on `url`: its backend's generation and the calls waiting on it."""
        return self._backends.setdefault((url, model), Backend())

    def backend_died(self, url: str, model: str) -> None:
        """The model's backend died (a new call was told so, or the platform's watchdog saw
        it): every call waiting on it ends now with BackendDied (a dead stub's calls would
        wait for good); calls made from here on belong to the next generation."""
        self.backend(url, model).died()

    async def inputs(self, url: str, model: str) -> frozenset[str]:
        """The names of a model's inputs (its metadata, kept for a minute: a model may be
        reloaded as another kind)."""
        key, now = (url, model), time.monotonic()
        cached = self._inputs.get(key)
        if cached is None or now - cached[0] > 60.0:
            if _over_http(url):
                meta = await self.http.metadata(url, model)
            else:
                meta = await self.get(url).get_model_metadata(model, as_json=True, client_timeout=self.timeout)
            cached = self._inputs[key] = (now, frozenset(i["name"] for i in meta.get("inputs", [])))
        return cached[1]

    async def ready(self, url: str, model: str, timeout: float) -> bool:
        if _over_http(url):
            return await self.http.ready(url, model, timeout)
        try:
            return bool(await self.get(url).is_model_ready(model, client_timeout=timeout))
        except (InferenceServerException, grpc.RpcError, OSError):
            return False

    async def infer(self, url: str, model: str, inputs: list[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """One KServe v2 inference (inputs: name, array; strings as an object array): every
        output the model gives, by name (a model need not give the optional `tokens`)."""
        if _over_http(url):
            return await self.http.infer(url, model, inputs)
        tensors = [_tensor(name, array) for name, array in inputs]
        result = await self.get(url).infer(model, tensors, client_timeout=self.timeout)
        return {out.name: result.as_numpy(out.name) for out in result.get_response().outputs}

    def events(self, url: str, model: str, body: str, endpoint: str, timeout: float | None = None,
               keepalive_s: float = 0.0) -> AsyncIterator[tuple[int, str]]:  # fmt: skip
        """(status, event) of each server-sent event (or the whole body) the chat model `model`
        answers to the OpenAI `body` for `endpoint` (chat_events; `timeout`: this client's);
        `keepalive_s` > 0 asks the model for keep-alives (skipped here) on a quiet call."""
        if _over_http(url):
            fields: dict = {"request": body, "endpoint": endpoint}
            if keepalive_s > 0:
                fields["keepalive_s"] = keepalive_s
            responses = self.http.responses(url, model, fields)
        else:
            inputs = [_strings("request", [body], [1]), _strings("endpoint", [endpoint], [1])]
            if keepalive_s > 0:
                inputs.append(grpcclient.InferInput("keepalive_s", [1], "FP32"))
                inputs[-1].set_data_from_numpy(np.array([keepalive_s], dtype=np.float32))
            responses = _grpc_responses(self.get(url), {"model_name": model, "inputs": inputs})
        return chat_events(responses, self.timeout if timeout is None else timeout, self.backend(url, model))

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        await self.http.close()


def _over_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def _strings(name: str, texts: list[str], shape: list[int]) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, shape, "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_).reshape(shape))
    return tensor


def _tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    if array.dtype == np.object_:
        return _strings(name, list(array.reshape(-1)), list(array.shape))
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def _texts(texts: list[str], shape: list[int]) -> np.ndarray:
    return np.array(texts, dtype=np.object_).reshape(shape)


def _message(exc: InferenceServerException) -> str:
    """Triton's message without the Python backend's traceback ("At: /path/model.py(17)...")."""
    return (exc.message() or str(exc)).split("\n\nAt:\n")[0].strip()


def _client_fault(exc: InferenceServerException) -> bool:
    """The model refused the request itself (a 400: a bad value, a call this model does not
    take), as opposed to failing (a 5xx: retried on another replica). The chat model answers
    its refusals as OpenAI errors instead; these are the embed and rerank models' gRPC errors."""
    return any(name in str(exc.status() or "") for name in ("INVALID_ARG", "UNIMPLEMENTED", "OUT_OF_RANGE"))


def _json(status: int, body: dict) -> Opened:
    return Opened(status, json.dumps(body).encode(), None, None, _nothing)


def _tokens(outputs: dict[str, np.ndarray]) -> int | None:
    """The tokens a call's rows were (the models' `tokens` output; None from a model without it)."""
    tokens = outputs.get("tokens")
    return None if tokens is None else int(tokens.sum())


def _usage(counts: list[int | None]) -> dict | None:
    """Usage as `llmserve serve --task embed` gives it (None when a count is missing: the
    limits then keep the reservation)."""
    if not counts or None in counts:
        return None
    total = sum(counts)
    return PoolingUsage(prompt_tokens=total, total_tokens=total).model_dump()


def _id_rows(rows: list[list[int]]) -> np.ndarray:
    """Token-id rows as one INT64 tensor, shorter rows padded with -1 (the embed model's pad)."""
    width = max(len(r) for r in rows)
    return np.array([r + [-1] * (width - len(r)) for r in rows], dtype=np.int64)


async def _embeddings(clients: TritonClients, url: str, ctx: RequestContext, model: str) -> dict:
    call = embeddings_call(ctx.payload)
    if call.token_ids and "token_ids" not in await clients.inputs(url, model):
        raise BadRequest(f"the model {ctx.alias!r} takes text only, not token ids")
    inputs = call.token_ids or call.texts
    rows, counts = [], []
    for start in range(0, len(inputs), EMBED_BATCH):
        part = inputs[start : start + EMBED_BATCH]
        tensor = ("token_ids", _id_rows(part)) if call.token_ids else ("text", _texts(part, [len(part), 1]))
        outputs = await clients.infer(url, model, [tensor])
        rows.extend(outputs["embedding"])
        counts.append(_tokens(outputs))
    if call.dimensions is not None and rows and call.dimensions != len(rows[0]):
        raise BadRequest(f"this model's embeddings have {len(rows[0])} dimensions; `dimensions` cannot change "
                         f"that (got {call.dimensions})")  # fmt: skip
    data = [{"object": "embedding", "index": i, "embedding": embedding_json(v, call.base64)}
            for i, v in enumerate(rows)]  # fmt: skip
    body = {"object": "list", "data": data, "model": ctx.alias}
    if (usage := _usage(counts)) is not None:
        body["usage"] = usage
    return body


async def _rerank(clients: TritonClients, url: str, ctx: RequestContext, model: str) -> dict:
    call = rerank_call(ctx.payload)
    docs = call.documents
    inputs = [("query", _texts([call.query], [1, 1])), ("documents", _texts(docs, [1, len(docs)]))]
    outputs = await clients.infer(url, model, inputs)
    scores = outputs["scores"][0]
    results = []
    for i in rerank_order(scores, call.top_n):
        result = {"index": i, "relevance_score": float(scores[i])}
        if call.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    body = {"id": f"rerank-{uuid.uuid4().hex}", "model": ctx.alias, "created": int(time.time())}
    if (usage := _usage([_tokens(outputs)])) is not None:
        body["usage"] = usage
    return {**body, "results": results}


def _chat_request(ctx: RequestContext, pick: Pick, request_timeout_s: float | None = None) -> tuple[str, bool]:
    """The OpenAI body for the chat model, and whether the client asked for the stream's usage
    itself; `request_timeout_s` caps the request's own deadline (a value that is not a number
    is left for the model to refuse)."""
    payload = dict(ctx.payload)
    own = payload.get("request_timeout_s")
    if request_timeout_s is not None and (own is None or (isinstance(own, int | float) and own > request_timeout_s)):
        payload["request_timeout_s"] = request_timeout_s
    if pick.route.lora:  # the chat model runs the request with this adapter
        payload["model"] = pick.route.lora
    payload.pop("priority", None)  # a client does not pick its own priority: its key does
    if pick.route.send_priority and ctx.priority:
        payload["priority"] = -ctx.priority  # vLLM-style: lower is served first
    options = payload.get("stream_options")
    asked = isinstance(options, dict) and options.get("include_usage") is True
    if ctx.stream:
        payload["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return json.dumps(payload, ensure_ascii=False), asked


class BackendDied(InferenceServerException):
    """The backend a call was waiting on died: nothing more will come."""

    def __init__(self) -> None:
        super().__init__("the model's backend died (its stub process is gone)", status="StatusCode.UNAVAILABLE")


class Backend:
    """One model on one replica: a generation counter, bumped when its backend dies, and the
    calls waiting for a response from it (their tasks, cancelled on a death, as asyncio.timeout
    cancels: cheap enough to wrap every response of a stream)."""

    def __init__(self) -> None:
        self.generation = 0
        self.waiting: set[_DeathWatch] = set()

    def died(self) -> None:
        self.generation += 1
        waiting, self.waiting = self.waiting, set()
        for watch in waiting:
            watch.fire()

    def watch(self, generation: int) -> _DeathWatch:
        return _DeathWatch(self, generation)


class _DeathWatch:
    """`async with backend.watch(generation):` around one wait for a response: BackendDied
    if the backend died before or while it waits."""

    def __init__(self, backend: Backend, generation: int) -> None:
        self.backend, self.generation = backend, generation
        self.task: asyncio.Task | None = None
        self._cancelling = 0
        self.fired = False

    async def __aenter__(self) -> _DeathWatch:
        if self.backend.generation != self.generation:
            raise BackendDied()
        self.task = asyncio.current_task()
        self._cancelling = self.task.cancelling()  # cancellations already pending are not ours
        self.backend.waiting.add(self)
        return self

    async def __aexit__(self, kind, exc, tb) -> bool:
        self.backend.waiting.discard(self)
        if self.fired and kind is asyncio.CancelledError and self.task.uncancel() <= self._cancelling:
            raise BackendDied() from None  # cancelled by `fire` alone (not by a client leaving)
        return False

    def fire(self) -> None:
        if not self.fired and self.task is not None:
            self.fired = True
            self.task.cancel()


async def _grpc_responses(client, request: dict) -> AsyncIterator[tuple[int, str]]:
    """(status, text) of each response of the chat model's gRPC call; cancelled when closed
    before the server ended it."""

    async def one_request():
        yield request

    stream = client.stream_infer(one_request())
    ended = False
    try:
        async for result, error in stream:
            if error is not None:
                raise error
            if result.get_response().outputs:  # (the final flag alone carries none)
                yield int(result.as_numpy("status").reshape(-1)[0]), result.as_numpy("response").reshape(-1)[0].decode()
        ended = True
    finally:
        if not ended:  # the client went away mid-stream (or the call would not end): abort it
            stream.cancel()


async def chat_events(responses: AsyncIterator[tuple[int, str]], timeout: float,
                      backend: Backend) -> AsyncIterator[tuple[int, str]]:  # fmt: skip
    """(status, text) of each event in the chat model's `responses` (a response may carry
    several); a whole body or a refusal is one; closing it early cancels the call;
    TimeoutError when the next response takes over `timeout` seconds (a model that died),
    BackendDied as soon as `backend` dies (the platform found it dead).

    A finished request's call is left for the server to end, not cancelled: Triton 2.51
    can crash (SIGSEGV) when a cancellation races the completion of a request, a race
    fixed only in later releases (triton-inference-server/server#7840, #8034), and a CI
    run here hit it."""
    generation = backend.generation
    try:
        while True:
            try:
                async with asyncio.timeout(timeout), backend.watch(generation):
                    status, text = await anext(responses)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise TimeoutError(f"no response from the Triton model within {timeout:g} s") from None
            if text == KEEPALIVE:  # the model is alive, and Triton's connection written to: nothing to pass on
                continue
            for event in split_events(text):  # a busy model sends a stream's waiting events together
                last = not event.startswith("data: ") or event == "data: [DONE]"  # a whole body, or the stream's end
                if last:
                    await _call_ended(responses)
                yield status, event
                if last:
                    return
    finally:
        await responses.aclose()


async def _call_ended(responses: AsyncIterator, timeout: float = 2.0) -> None:
    """Wait for the server to end a call whose request has finished (we sent one request,
    and the server ends the call after its final response); one that does not end within
    `timeout` is cancelled when `responses` is closed."""
    try:
        async with asyncio.timeout(timeout):
            async for _ in responses:
                pass
    except (TimeoutError, grpc.RpcError, InferenceServerException, CallBroken):
        pass


def _usage_only(line: str) -> dict | None:
    """The usage of a stream's usage chunk (no choices), else None."""
    if not line.startswith('data: {"') or '"usage"' not in line:
        return None
    try:
        chunk = json.loads(line[len("data: ") :])
    except ValueError:
        return None
    return chunk["usage"] if isinstance(chunk, dict) and not chunk.get("choices") and chunk.get("usage") else None


async def _generate(clients: TritonClients, ctx: RequestContext, pick: Pick, model: str,
                    keepalive_s: float = 0.0) -> Opened:  # fmt: skip
    body, asked_usage = _chat_request(ctx, pick, clients.request_timeout_s)
    responses = clients.events(pick.replica.url, model, body, ctx.path, keepalive_s=keepalive_s)
    try:
        status, first = await anext(responses)  # errors before this are retried elsewhere
    except StopAsyncIteration:
        raise InferenceServerException("the chat model ended the call without an answer") from None
    except BaseException:
        await responses.aclose()
        raise
    if not first.startswith("data: "):  # a whole body or a refusal: the call is over
        await responses.aclose()
        if status >= 500 and status != 504:  # (a 504 is the request's own deadline: its answer, not a failure)
            message = (json.loads(first).get("error") or {}).get("message", first)
            raise _failed(pick, status, f"the Triton model failed: {message}", "upstream_failed")
        return Opened(status, first.encode(), None, None, _nothing)

    async def lines() -> AsyncIterator[str]:
        """Each event with the blank line that ends it (so a client's SSE parser takes it at once)."""
        async for _status, line in responses:
            usage = _usage_only(line)
            if usage is not None:
                ctx.saw_usage(usage)  # the limits settle with it
                if not asked_usage:
                    continue
            yield line + "\n"

    rest = lines()

    async def close() -> None:
        await rest.aclose()
        await responses.aclose()

    return Opened(200, None, rest, first + "\n", close)


async def _nothing() -> None:
    return None


async def open_triton(clients: TritonClients, ctx: RequestContext, pick: Pick) -> Opened:
    model = pick.route.model or pick.alias
    url = pick.replica.url
    try:
        needed = ENDPOINT_INPUTS.get(ctx.path, ENDPOINT_INPUTS["/v1/completions"])
        inputs = await clients.inputs(url, model)
        if not needed <= inputs:  # e.g. a chat call to the embed model
            raise BadRequest(f"the model {ctx.alias!r} does not serve {ctx.path} (a Triton model taking "
                             f"{', '.join(sorted(needed))} does)")  # fmt: skip
        if ctx.path == "/v1/embeddings":
            return _json(200, await _embeddings(clients, url, ctx, model))
        if ctx.path == "/v1/rerank":
            return _json(200, await _rerank(clients, url, ctx, model))
        # keep-alives on a quiet call, so that Triton notices the call closed when its client leaves
        return await _generate(clients, ctx, pick, model, KEEPALIVE_S if "keepalive_s" in inputs else 0.0)
    except BadRequest as exc:
        return _json(400, error_body(400, str(exc), code="invalid_request"))
    except InferenceServerException as exc:
        message = _message(exc)
        if "is not healthy" in message:  # its stub died: the calls still waiting on it are over too
            clients.backend_died(url, model)
        if _client_fault(exc):
            return _json(400, error_body(400, f"the Triton model refused the request: {message}",
                                         code="upstream_rejected"))  # fmt: skip
        if "RESOURCE_EXHAUSTED" in str(exc.status() or ""):  # its queue is full: busy, not broken
            raise _failed(pick, 503, f"the Triton model is overloaded: {message}", "upstream_overloaded") from exc
        # the model or server failed (unreachable, a dead backend stub, a crash): another
        # replica may answer; the breaker counts it
        raise _failed(pick, 502, f"the Triton model failed: {message}", "upstream_failed", _down(exc),
                      accepted=isinstance(exc, BackendDied)) from exc  # fmt: skip
    except CallBroken as exc:  # over HTTP: the call itself broke, or no connection was made
        raise _failed(pick, 502, f"the Triton call failed: {exc.why}", "upstream_failed", unavailable=True,
                      accepted=not exc.refused) from exc  # fmt: skip
    except grpc.RpcError as exc:  # the call itself broke (Triton went away mid-call, or was not there)
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        why = code.name if code is not None else type(exc).__name__
        details = str(exc.details() if callable(getattr(exc, "details", None)) else exc)
        refused = "failed to connect" in details.lower() or "connection refused" in details.lower()
        raise _failed(pick, 502, f"the Triton call failed: {why}", "upstream_failed", unavailable=True,
                      accepted=not refused) from exc  # fmt: skip
    except TimeoutError as exc:
        message = f"the Triton model did not answer within {clients.timeout:g} s"
        raise _failed(pick, 504, message, "upstream_timeout") from exc


# what Triton says while a model cannot take requests at all: its stub died, or it is being
# (re)loaded, or the server is unreachable; waiting for the watchdog's restart may help
_DOWN = ("UNAVAILABLE", "is not healthy", "unknown model", "is not ready", "not found")


def _down(exc: InferenceServerException) -> bool:
    text = f"{exc.status() or ''} {_message(exc)}"
    return any(marker in text for marker in _DOWN)


def _failed(pick: Pick, status: int, message: str, code: str, unavailable: bool = False,
            accepted: bool = False) -> UpstreamFailed:  # fmt: skip
    """A replica's failure: another replica is tried; if none answers, the client gets this
    status and message (a 503 is busy, not broken: no breaker count)."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    return UpstreamFailed(f"Triton replica {pick.replica.url}: {message}", status, body,
                          overloaded=status == 503, unavailable=unavailable, accepted=accepted)  # fmt: skip
