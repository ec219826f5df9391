"""`/v1/chat/completions`: the tokenizer's chat template, then one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import PreTrainedTokenizerBase

from llmserve import chat_template
from llmserve.chat_template import ChatTemplateError, NoChatTemplateError
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.serve.errors import APIError
from llmserve.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from llmserve.serve.state import ServerState, merge_streams, resolve_max_tokens, run_until_disconnect
from llmserve.serve.streaming import DeltaTracker, sse, sse_stream
from llmserve.serve.tools import ToolPlan, plan_tools, scan_calls, template_messages


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    template_kwargs: dict | None = None, tools: list[dict] | None = None,
) -> list[int]:  # fmt: skip
    """`chat_template.render_chat`, its errors as 400s."""
    try:
        return chat_template.render_chat(tokenizer, messages, add_generation_prompt, template_kwargs, tools)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), code="no_chat_template" if isinstance(exc, NoChatTemplateError) else None) from None


def chat_logprobs(out: CompletionOutput, start: int) -> ChatLogprobs:
    content = []
    for token, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        chosen = entry[token]
        top = sorted(entry.values(), key=lambda e: e.rank or 0)
        content.append(
            ChatTokenLogprob(
                token=chosen.decoded_token or "",
                logprob=chosen.logprob,
                bytes=list((chosen.decoded_token or "").encode()),
                top_logprobs=[
                    TopLogprob(token=e.decoded_token or "", logprob=e.logprob, bytes=list((e.decoded_token or "").encode()))
                    for e in top
                ],
            )
        )
    return ChatLogprobs(content=content)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    engine = state.require_engine()
    model = state.resolve_model(req.model)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, "top_logprobs must be in [0, 20]", param="top_logprobs")
    tools = plan_tools(req, state.config.tool_call_parser)
    ids = render_chat(engine.tokenizer, template_messages(req.messages), req.add_generation_prompt, req.chat_template_kwargs,
                      tools.template_tools if tools else None)  # fmt: skip
    max_tokens = resolve_max_tokens(len(ids), req.requested_max_tokens(), engine.model_config.max_model_len)
    params = req.to_sampling_params(max_tokens)
    if tools is not None and tools.constraint is not None:
        params.structured_outputs = tools.constraint
    if tools is not None and tools.mode == "auto":  # the parser reads the call tags, special tokens or not
        params.skip_special_tokens = False
    await engine.check_params(params)  # before a stream starts: a bad spec is a 400, not an error event
    request_id = random_id("chatcmpl")
    stream = engine.generate({"prompt_token_ids": ids}, params, request_id, req.priority)
    if req.stream:
        events = _stream(req, model, request_id, stream, tools)
        return StreamingResponse(sse_stream(events), media_type="text/event-stream")
    final = await run_until_disconnect(request, _last(stream))
    return JSONResponse(_response(req, model, request_id, final, tools).model_dump())


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for _, out in merge_streams([stream]):
        final = out
    return final


def _response(
    req: ChatCompletionRequest, model: str, request_id: str, final: RequestOutput, tools: ToolPlan | None
) -> ChatCompletionResponse:  # fmt: skip
    choices = []
    for out in final.outputs:
        content, calls = tools.parse(out.text) if tools else (out.text, [])
        choices.append(ChatChoice(
            index=out.index,
            message=ChatResponseMessage(content=content, tool_calls=calls),
            logprobs=chat_logprobs(out, 0) if req.logprobs else None,
            finish_reason=tools.finish_reason(calls, out.finish_reason) if tools else out.finish_reason,
            stop_reason=out.stop_reason,
        ))  # fmt: skip
    prompt = len(final.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in final.outputs)
    usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


@dataclass
class _Sent:
    """What a stream sent of one choice whose text may hold tool calls."""

    chars: int = 0  # of the text, as content ("auto")
    tokens: int = 0  # whose logprobs went out
    calls: list[list] = field(default_factory=list)  # "required": per call [id, chars of arguments]


def _held_delta(
    tools: ToolPlan, comp: CompletionOutput, sent: _Sent, logprobs: bool
) -> tuple[DeltaMessage, ChatLogprobs | None, str | None] | None:  # fmt: skip
    """The next delta of a choice whose text may hold tool calls. "auto": the text a stream
    may send now (`ToolPlan.streamable_text`), the calls at the end. "required": each call's
    id and name once known, then its arguments as they grow. Output that holds no readable
    calls at the end goes out as content, as in the reply. None: nothing to send yet."""
    done = comp.finish_reason is not None
    final_calls = tools.parse(comp.text)[1] if done else []
    if tools.mode == "required":
        text = comp.text if done and not final_calls else ""
        calls = _call_deltas(comp.text, sent.calls)
    else:
        end = tools.streamable_text(comp.text) if final_calls or not done else len(comp.text)
        text, sent.chars = comp.text[sent.chars : end], max(sent.chars, end)
        calls = [DeltaToolCall(index=k, id=c.id, type="function", function=DeltaFunctionCall(**c.function.model_dump()))
                 for k, c in enumerate(final_calls)]  # fmt: skip
    if not text and not calls and not done:
        return None
    lp = chat_logprobs(comp, sent.tokens) if logprobs else None
    sent.tokens = len(comp.token_ids)
    finish = tools.finish_reason(final_calls, comp.finish_reason) if done else None
    return DeltaMessage(content=text or None, tool_calls=calls or None), lp, finish


def _call_deltas(text: str, sent: list[list]) -> list[DeltaToolCall]:
    """What is new of each call of a "required" output (`scan_calls`) since `sent`."""
    out = []
    for k, call in enumerate(scan_calls(text)):
        if call.name is None:
            break
        head = k == len(sent)
        if head:
            sent.append([random_id("chatcmpl-tool"), 0])
        new = call.arguments[sent[k][1] :]
        if not head and not new:
            continue
        sent[k][1] = len(call.arguments)
        out.append(DeltaToolCall(
            index=k, id=sent[k][0] if head else None, type="function" if head else None,
            function=DeltaFunctionCall(name=call.name if head else None, arguments=new),
        ))  # fmt: skip
    return out


async def _stream(
    req: ChatCompletionRequest, model: str, request_id: str, stream: AsyncIterator[RequestOutput],
    tools: ToolPlan | None,
) -> AsyncIterator[str]:
    """Text deltas as they come; a named tool's arguments as deltas of its call; "required"
    calls as deltas of each; with "auto" tools text up to a `<tool_call>`, the calls when the
    output ends."""
    created = int(time.time())
    deltas = DeltaTracker()
    held_sent: dict[int, _Sent] = {}  # "auto"/"required": per choice
    role_sent: set[int] = set()
    prompt_tokens = 0

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage))

    async for _, out in merge_streams([stream]):
        prompt_tokens = len(out.prompt_token_ids)
        for comp in out.outputs:
            i = comp.index
            if i not in role_sent:
                role_sent.add(i)
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            delta = deltas.next(i, comp)
            if delta is None:
                continue
            if tools is not None and tools.mode in ("auto", "required"):  # the text may hold calls
                held = _held_delta(tools, comp, held_sent.setdefault(i, _Sent()), req.logprobs)
                if held is not None:
                    message, logprobs, finish = held
                    yield chunk([ChatStreamChoice(index=i, delta=message, logprobs=logprobs, finish_reason=finish,
                                                  stop_reason=comp.stop_reason)])  # fmt: skip
                continue
            logprobs = chat_logprobs(comp, delta.token_from) if req.logprobs else None
            message = DeltaMessage(content=delta.text)
            if tools is not None and tools.mode == "named":  # the text is the call's arguments
                first = delta.token_from == 0
                message = DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, id=random_id("chatcmpl-tool") if first else None, type="function" if first else None,
                    function=DeltaFunctionCall(name=tools.function if first else None, arguments=delta.text),
                )])  # fmt: skip
            yield chunk([
                ChatStreamChoice(
                    index=i, delta=message, logprobs=logprobs,
                    finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                )
            ])  # fmt: skip
    if req.stream_options and req.stream_options.include_usage:
        completion = deltas.completion_tokens
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
        yield chunk([], usage)
