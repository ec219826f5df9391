"""The Responses API over a chat path: create (a body, a stream of typed events, or a background
run), retrieve, delete, list input items, cancel. A response is a chat request underneath
(items.py builds it); a `Runner` runs that request and gives the answer as `Piece`s (thoughts,
text, tool calls) and its `Ended` (cut short or not, usage). Here they become output items
(`reasoning`, `message`, `function_call`) and the events OpenAI sends, in its order, each with
its `sequence_number`. A body and a background run are the same events, drained. Two runners:
engine_runner.py's (`plan_chat` and `MessageStream` on an engine: `llmserve serve`) and the
gateway's (a chat completions stream from its upstreams: llmserve/gateway/responses.py). No web
framework and no engine here."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.errors import EngineDeadError
from llmserve.openai.deadline import effective_timeout
from llmserve.openai.errors import APIError
from llmserve.openai.protocol import ChatCompletionRequest, DeltaToolCall
from llmserve.openai.reply import Reply
from llmserve.responses.items import ResponsesRequest, chat_messages, chat_request, new_id, normalize_items
from llmserve.responses.storage import ResponseStorage
from llmserve.responses.store import UNFINISHED

if TYPE_CHECKING:  # (not imported: the gateway uses this module without the engine and torch)
    from llmserve.engine.protocol import EngineClient
    from llmserve.lora_request import LoRARequest

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 10.0  # the longest a cancel waits for its background run to stop


@dataclass
class Piece:
    """What one step of the answer added: thoughts, answer text, tool call deltas."""

    thought: str = ""
    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass
class Ended:
    """The answer's end: cut short by max_output_tokens or not, and the Responses usage."""

    cut_short: bool
    usage: dict


@dataclass
class ChatRun:
    """A chat request started: its pieces, then one `Ended` (the last item); the prompt's
    token ids where the runner knows them."""

    pieces: AsyncIterator[Piece | Ended]
    prompt_token_ids: list[int] | None = None


# runs a response's chat request (named by the response's id): APIError (or a refusal of the
# caller's) before anything runs, when the request is wrong or cannot be served
Runner = Callable[[ChatCompletionRequest, str], Awaitable[ChatRun]]


def response_usage(prompt: int, output: int, reasoning: int, cached: int | None = None) -> dict:
    """The Responses API's usage from a chat's counts."""
    return {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached or 0},
        "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + output,
    }  # fmt: skip


def _not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{rid[:100]}' not found.", param=param)


def response_object(rid: str, req: ResponsesRequest, model: str, status: str) -> dict:
    """A Response (openai.types.responses.Response) before any output."""
    return {
        "id": rid, "object": "response", "created_at": time.time(), "status": status,
        "background": req.background, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "metadata": req.metadata or {}, "model": model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
        "usage": None, "user": req.user, "completed_at": None,
    }  # fmt: skip


class _Items:
    """The output items of one run as its text grows, and the events that say so."""

    def __init__(self, response: dict) -> None:
        self.response = response
        self.output: list[dict] = response["output"]
        self.seq = 0
        self.open: dict | None = None  # the reasoning or message item being written
        self.calls: dict[int, dict] = {}  # tool call index -> its function_call item
        self.pending = ""  # blanks before a message is known to be one (before a call they are dropped)

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))

    def _start(self, item: dict, part: dict | None) -> list[dict]:
        self.output.append(item)
        added = {**item, "content": []} if part is not None else dict(item)
        events = [self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)]
        if part is not None:
            item["content"] = [part]
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.output) - 1, content_index=0, part={**part, "text": ""}))  # fmt: skip
        return events

    def _close_open(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index, part = self.output.index(item), item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = [self.event("response.reasoning_text.done", **where, text=part["text"])]
        else:
            done = [self.event("response.output_text.done", **where, text=part["text"], logprobs=[])]
        return [*done, self.event("response.content_part.done", **where, part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=dict(item))]  # fmt: skip

    def thought(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._close_open("completed")
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            events += self._start(item, {"type": "reasoning_text", "text": ""})
            self.open = item
        part = self.open["content"][0]
        part["text"] += text
        return [*events, self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                    output_index=self.output.index(self.open), content_index=0, delta=text)]  # fmt: skip

    def text(self, text: str, final: bool = False) -> list[dict]:
        if self.open is None or self.open["type"] != "message":
            if not final and not (self.pending + text).strip():
                self.pending += text
                return []
            text, self.pending = self.pending + text, ""
            events = self._close_open("completed")
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress"}
            events += self._start(item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self.open = item
        else:
            events = []
        self.open["content"][0]["text"] += text
        return [*events, self.event("response.output_text.delta", item_id=self.open["id"],
                                    output_index=self.output.index(self.open), content_index=0, delta=text,
                                    logprobs=[])]  # fmt: skip

    def call(self, delta) -> list[dict]:
        """One DeltaToolCall: a new function_call item (its id and name), then its arguments as they grow."""
        events = self._close_open("completed")
        self.pending = ""
        item = self.calls.get(delta.index)
        if item is None:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": delta.id, "name": delta.function.name,
                    "arguments": "", "status": "in_progress"}  # fmt: skip
            self.calls[delta.index] = item
            events += self._start(item, None)
        if delta.function.arguments:
            item["arguments"] += delta.function.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=delta.function.arguments))  # fmt: skip
        return events

    def finish(self, status: str) -> list[dict]:
        """Every open item closed (`status`: completed, or incomplete when cut short)."""
        events = []
        if self.pending and not self.calls:  # blanks only: still the answer
            events += self.text("", final=True)
        events += self._close_open(status)
        for item in self.calls.values():
            item["status"] = status
            index = self.output.index(item)
            events += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=index, item=dict(item))]  # fmt: skip
        return events


class Responses:
    """The Responses API of one server: its store (opened on first use by `open_store`), and the
    background runs in flight."""

    def __init__(self, open_store: Callable[[], ResponseStorage], tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, request_timeout_s: float | None = None) -> None:  # fmt: skip
        self._open_store = open_store
        self._store: ResponseStorage | None = None
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.request_timeout_s = request_timeout_s
        self.background: dict[str, asyncio.Task] = {}

    async def store(self) -> ResponseStorage:
        if self._store is None:
            try:
                self._store = await asyncio.to_thread(self._open_store)
            except Exception as exc:  # noqa: BLE001 - sqlite3 and OS errors: the operator's to fix
                logger.error("the responses store cannot be opened: %s", exc)
                raise APIError(503, f"the responses store cannot be opened: {exc}", code="store_unavailable") from None
        return self._store

    async def _stored(self, namespace: str, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        found = await asyncio.to_thread((await self.store()).get, namespace, rid)
        if found is None:
            raise _not_found(rid, param)
        return found

    def runner(self, engine: EngineClient, lora_request: LoRARequest | None = None) -> Runner:
        """This server's chat path on `engine` (its tool and reasoning parsers)."""
        from llmserve.responses.engine_runner import engine_runner

        return engine_runner(engine, self.tool_call_parser, self.reasoning_parser, lora_request)

    async def create(self, req: ResponsesRequest, model: str, namespace: str, runner: Runner) -> Reply:
        """Start `req` (its chat request run by `runner`): a Reply with its body (the whole
        response), its events, or (background) the response as it is now. APIError for what is
        wrong before anything runs."""
        if req.background and not req.store:
            raise APIError(400, "background responses need store = true", param="background")
        if req.background and req.stream:
            raise APIError(400, "a background response is not streamed here: retrieve it instead", param="stream")
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous, before = await self._stored(namespace, req.previous_response_id, "previous_response_id")
            if previous["status"] in UNFINISHED:
                raise APIError(400, f"the previous response {req.previous_response_id!r} is still {previous['status']}",
                               param="previous_response_id")  # fmt: skip
            history = before + previous["output"]
        items = history + normalize_items(req.input)
        chat = chat_request(req, chat_messages(items, req.instructions))
        store = await self.store() if req.store else None  # (before the run starts: a 503 leaves nothing running)
        rid = new_id("resp")
        started = await runner(chat, rid)
        response = response_object(rid, req, model, "queued" if req.background else "in_progress")
        if req.return_token_ids and started.prompt_token_ids is not None:
            response["prompt_token_ids"] = started.prompt_token_ids
        try:
            if store is not None:
                await asyncio.to_thread(store.put, namespace, response, items)
        except BaseException:
            await started.pieces.aclose()
            raise
        timeout = effective_timeout(req.request_timeout_s, self.request_timeout_s)
        run = self._run(_Items(response), started.pieces, store, namespace, timeout)
        if req.background:
            task = asyncio.create_task(_drain(run))
            self.background[rid] = task
            task.add_done_callback(lambda _: self.background.pop(rid, None))
            snapshot = json.loads(json.dumps(response))
            return Reply(body=_ready(snapshot))
        if req.stream:
            return Reply(events=_sse(run))

        async def body() -> dict:
            await _drain(run)
            return response

        return Reply(body=body())

    async def _run(self, items: _Items, pieces: AsyncIterator[Piece | Ended], store: ResponseStorage | None,
                   namespace: str, timeout: float | None) -> AsyncIterator[dict]:  # fmt: skip
        """The events of one response, its stored copy kept up to date."""
        response = items.response
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        finished = False
        try:
            response["status"] = "in_progress"
            if store is not None:
                await asyncio.to_thread(store.update, namespace, response)
            yield items.event("response.created", response=items.snapshot())
            yield items.event("response.in_progress", response=items.snapshot())
            ended: Ended | None = None
            async with aclosing(pieces):
                while ended is None:
                    try:
                        async with asyncio.timeout_at(deadline):
                            piece = await anext(pieces)
                    except StopAsyncIteration:
                        raise APIError(502, "the answer ended before it was complete", code="upstream_failed") from None
                    except TimeoutError:
                        raise APIError(504, f"the response did not finish within {timeout:g} s (request_timeout_s): "
                                            "it was stopped", code="request_timeout") from None  # fmt: skip
                    if isinstance(piece, Ended):
                        ended = piece
                        continue
                    for event in [*(items.thought(piece.thought) if piece.thought else []),
                                  *(items.text(piece.content) if piece.content else []),
                                  *(e for call in piece.calls for e in items.call(call))]:  # fmt: skip
                        yield event
            for event in items.finish("incomplete" if ended.cut_short else "completed"):
                yield event
            response["status"] = "incomplete" if ended.cut_short else "completed"
            if ended.cut_short:
                response["incomplete_details"] = {"reason": "max_output_tokens"}
            response["usage"] = ended.usage
            response["completed_at"] = time.time()
            finished = True
            if store is not None:
                await asyncio.to_thread(store.update, namespace, response)
            yield items.event(f"response.{response['status']}", response=items.snapshot())
        except (APIError, EngineDeadError, ValueError, Exception) as exc:  # noqa: BLE001 - the run ends with its reason
            if isinstance(exc, APIError):
                code, message = exc.code or "server_error", exc.message
            elif isinstance(exc, EngineDeadError):
                code, message = "engine_dead", f"the engine is not running: {exc}"
            else:
                logger.exception("error in a response")
                code, message = "server_error", f"internal error: {type(exc).__name__}"
            response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": message}
            finished = True
            if store is not None:
                store.update(namespace, response)
            yield items.event("error", code=code, message=message, param=None)
            yield items.event("response.failed", response=items.snapshot())
        finally:
            if not finished:  # cancelled (POST .../cancel), or the client left: stopped, as it is
                response["status"] = "cancelled"
                if store is not None:
                    store.update(namespace, response)  # (no awaiting here: the run is being closed)

    async def retrieve(self, namespace: str, rid: str) -> dict:
        return (await self._stored(namespace, rid))[0]

    async def delete(self, namespace: str, rid: str) -> dict:
        await self._stop(rid)
        if not await asyncio.to_thread((await self.store()).delete, namespace, rid):
            raise _not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    async def cancel(self, namespace: str, rid: str) -> dict:
        response, _ = await self._stored(namespace, rid)
        if not response.get("background"):
            raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")
        if response["status"] in UNFINISHED:
            await self._stop(rid)
            response, _ = await self._stored(namespace, rid)
        return response

    async def input_items(self, namespace: str, rid: str, after: str | None = None, limit: int = 20,
                          order: str = "desc") -> dict:  # fmt: skip
        """The items the model saw before its output (OpenAI's list shape, `order` desc by default)."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be in [1, 100], got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be asc or desc, got {order!r}", param="order")
        _, items = await self._stored(namespace, rid)
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"no input item {after[:100]!r} in this response", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}  # fmt: skip

    async def _stop(self, rid: str) -> None:
        """Cancel the background run of `rid` (if one is in flight) and wait for it to stop."""
        task = self.background.get(rid)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=CANCEL_WAIT_S)

    async def close(self) -> None:
        """Stop every background run (each stored as cancelled), then close the store."""
        for rid in list(self.background):
            await self._stop(rid)
        if self._store is not None:
            self._store.close()


async def _drain(run: AsyncIterator[dict]) -> None:
    async with aclosing(run):
        async for _ in run:
            pass


async def _ready(value: dict) -> dict:
    return value


async def _sse(run: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The events as OpenAI sends them: `event: <type>` and `data: <json>` (no [DONE])."""
    async with aclosing(run):
        async for event in run:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
