"""Chat completions: the tokenizer's chat template, then one engine request (n samples), the
answer as a body or a stream (`Reply`). No web framework: `llmserve serve`, the Triton chat
model and anything else that has an engine call `chat_completion`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from llmserve import chat_template
from llmserve.chat_template import ChatTemplateError, NoChatTemplateError
from llmserve.engine.protocol import EngineClient
from llmserve.lora_request import LoRARequest
from llmserve.openai.engine_calls import adapter_kwargs, merge_streams, resolve_max_tokens
from llmserve.openai.errors import APIError
from llmserve.openai.fingerprint import system_fingerprint
from llmserve.openai.logprobs import chat_logprobs, prompt_logprobs_json
from llmserve.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionTokensDetails,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from llmserve.openai.reply import Reply
from llmserve.openai.streaming import DeltaTracker, sse, sse_stream
from llmserve.openai.token_bytes import TokenBytes, token_bytes_of
from llmserve.openai.tools import NO_TOOLS, ToolPlan, ToolStream, plan_tools, template_messages
from llmserve.outputs import RequestOutput
from llmserve.reasoning import ReasoningParser, UnknownReasoningParserError, prompt_tail
from llmserve.reasoning import reasoning_parser as make_reasoning_parser
from llmserve.reasoning.grammar import after_thoughts
from llmserve.sampling_params import SamplingParams


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    template_kwargs: dict | None = None, tools: list[dict] | None = None,
) -> list[int]:  # fmt: skip
    """`chat_template.render_chat`, its errors as 400s."""
    try:
        return chat_template.render_chat(tokenizer, messages, add_generation_prompt, template_kwargs, tools)
    except ChatTemplateError as exc:
        raise APIError(
            400, str(exc), code="no_chat_template" if isinstance(exc, NoChatTemplateError) else None
        ) from None


@dataclass(frozen=True, slots=True)
class _Answer:
    """What every choice and chunk of one chat answer is made with."""

    req: ChatCompletionRequest
    model: str
    request_id: str
    fingerprint: str
    token_bytes: TokenBytes
    tools: ToolPlan | None
    reasoning: ReasoningParser | None = None
    tokenizer: PreTrainedTokenizerBase | None = None  # counts the reasoning tokens (with a reasoning parser)

    def thoughts(self, outputs) -> int | None:
        """The reasoning tokens of finished `outputs` (CompletionOutputs; None without a parser)."""
        if self.reasoning is None:
            return None
        return sum(reasoning_tokens(self.tokenizer, o.token_ids, o.text, self.reasoning) for o in outputs)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """One chat request made ready to run: its prompt, sampling, tools and reasoning parser."""

    ids: list[int]  # the prompt's token ids, the chat template rendered
    params: SamplingParams
    tools: ToolPlan | None
    thinking: ReasoningParser | None
    arrival: float


async def plan_chat(engine: EngineClient, req: ChatCompletionRequest, tool_call_parser: str | None = None,
                    reasoning_parser: str | None = None) -> ChatPlan:  # fmt: skip
    """The prompt (the chat template rendered), sampling params, tool plan and reasoning parser of
    `req`; APIError (or ValueError) for what is wrong with it, before anything runs. Chat
    completions and the Responses API (llmserve/responses) both start here."""
    arrival = time.time()  # TTFT and latency count the template and tokenization too
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, "top_logprobs must be in [0, 20]", param="top_logprobs")
    tools = plan_tools(req, tool_call_parser)
    ids = await asyncio.to_thread(  # off the event loop: a long conversation takes a while to render and tokenize
        render_chat, engine.tokenizer, template_messages(req.messages), req.add_generation_prompt,
        req.chat_template_kwargs, tools.template_tools if tools else None)  # fmt: skip
    max_tokens = resolve_max_tokens(len(ids), req.requested_max_tokens(), engine.model_config.max_model_len)
    params = req.to_sampling_params(max_tokens)
    if tools is not None and tools.constraint is not None:
        params.structured_outputs = tools.constraint
    thinking = reasoning_setup(engine.tokenizer, ids, reasoning_parser)
    if thinking is not None and params.structured_outputs is not None:  # the constraint holds after the thoughts
        try:
            params.structured_outputs = after_thoughts(params.structured_outputs, thinking.state)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
    if tools is not None and tools.mode == "auto":  # the parser reads the call tags, special tokens or not
        params.skip_special_tokens = False
    if thinking is not None and thinking.state == "harmony":  # gpt-oss's message markers are special tokens
        params.skip_special_tokens = False
    await engine.check_params(params)  # before a stream starts: a bad spec is a 400, not an error event
    return ChatPlan(ids, params, tools, thinking, arrival)


async def chat_completion(engine: EngineClient, req: ChatCompletionRequest, model: str,
                          tool_call_parser: str | None = None, lora_request: LoRARequest | None = None,
                          reasoning_parser: str | None = None) -> Reply:  # fmt: skip
    """Start the request on `engine`; `model` is the name the answer carries. Raises APIError
    for what is wrong with the request before anything runs. With `reasoning_parser`
    (llmserve.reasoning) the thoughts come apart from the content, and the tool calls and any
    output constraint apply to the content."""
    plan = await plan_chat(engine, req, tool_call_parser, reasoning_parser)
    request_id = random_id("chatcmpl")
    stream = engine.generate({"prompt_token_ids": plan.ids}, plan.params, request_id, req.priority, plan.arrival,
                             **adapter_kwargs(lora_request))  # fmt: skip
    answer = _Answer(req, model, request_id, system_fingerprint(engine, lora_request), token_bytes_of(engine.tokenizer),
                     plan.tools, plan.thinking, engine.tokenizer)  # fmt: skip
    if req.stream:
        return Reply(events=sse_stream(_stream(answer, stream)))

    async def body() -> dict:
        return _response(answer, await _last(stream)).model_dump()

    return Reply(body=body())


def reasoning_setup(tokenizer, ids: list[int], name: str | None) -> ReasoningParser | None:
    """The parser `name` for a prompt of token ids `ids` (None: no parser)."""
    if name is None:
        return None
    try:
        return make_reasoning_parser(name, prompt_tail(tokenizer, ids))
    except UnknownReasoningParserError as exc:
        raise APIError(400, str(exc)) from None


def reply_parts(text: str, finish_reason: str | None, tools: ToolPlan | None,
                reasoning: ReasoningParser | None) -> tuple[str | None, str | None, list, str | None]:  # fmt: skip
    """(reasoning, content, tool calls, finish reason) of a finished output: the thoughts cut
    off first, the tool plan reading what follows them."""
    plan = tools or NO_TOOLS
    if reasoning is None:
        return (None, *plan.reply(text, finish_reason))
    cut = reasoning.split(text, done=True)
    if cut.content is None:  # still thinking when it stopped: no answer, no calls
        return cut.reasoning or None, None, [], finish_reason
    content, calls, finish = plan.reply(cut.content, finish_reason)
    return cut.reasoning or None, content or None, calls, finish


def reasoning_tokens(tokenizer, token_ids: list[int], text: str, reasoning: ReasoningParser | None) -> int | None:
    """How many of a finished output's tokens are its thoughts (None without a parser): all of
    them when the thoughts never closed; none when there were none; else the tokens before the
    answer begins: up to the one that completes `</think>`, or gpt-oss's first header of a
    message that is not reasoning (found by halving: whether a prefix of the tokens has begun
    the answer only grows with the prefix)."""
    if reasoning is None:
        return None
    cut = reasoning.split(text, done=True)
    if cut.content is None:
        return len(token_ids)
    if reasoning.state == "answering" or cut.content == text:
        return 0

    def answering(n: int) -> bool:
        return reasoning.split(tokenizer.decode(token_ids[:n], skip_special_tokens=False), False).content is not None

    lo, hi = 1, len(token_ids)  # the smallest prefix whose text has begun the answer
    if not answering(len(token_ids)):
        return 0
    while lo < hi:
        mid = (lo + hi) // 2
        if answering(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def usage_info(prompt_tokens: int, completion_tokens: int, thoughts: int | None = None) -> UsageInfo:
    """A chat answer's usage; with a reasoning parser (`thoughts` counted) its reasoning tokens too."""
    details = CompletionTokensDetails(reasoning_tokens=thoughts) if thoughts is not None else None
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, completion_tokens_details=details)  # fmt: skip


class MessageStream:
    """One choice's message, streamed from its growing text: the thoughts as reasoning deltas,
    then what follows them through `ToolStream` (content, tool calls)."""

    def __init__(self, tools: ToolPlan | None, reasoning: ReasoningParser | None) -> None:
        self.tools = ToolStream(tools)
        self.reasoning = reasoning
        self.sent = 0  # characters of reasoning sent

    def step(self, text: str, finish_reason: str | None):
        """(reasoning, content, tool call deltas, finish reason) new since the last step, for
        the cumulative `text`; None when there is nothing to send yet."""
        if self.reasoning is None:
            step = self.tools.step(text, finish_reason)
            return None if step is None else (None, *step)
        cut = self.reasoning.split(text, finish_reason is not None)
        thought, self.sent = cut.reasoning[self.sent :], len(cut.reasoning)
        if cut.content is None:
            step = (None, [], finish_reason) if finish_reason is not None else None
        else:
            step = self.tools.step(cut.content, finish_reason)
        if step is None:
            return (thought, None, [], None) if thought else None
        return (thought or None, *step)


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for _, out in merge_streams([stream]):
        final = out
    return final


def _response(a: _Answer, final: RequestOutput) -> ChatCompletionResponse:
    req = a.req
    ids = req.return_token_ids
    choices = []
    for out in final.outputs:
        reasoning, content, calls, finish = reply_parts(out.text, out.finish_reason, a.tools, a.reasoning)
        message = ChatResponseMessage(
            content=content, tool_calls=calls, reasoning=reasoning, reasoning_content=reasoning
        )
        choices.append(ChatChoice(
            index=out.index, message=message,
            logprobs=chat_logprobs(out, 0, req.top_logprobs or 0, a.token_bytes) if req.logprobs else None,
            finish_reason=finish, stop_reason=out.stop_reason, token_ids=out.token_ids if ids else None,
        ))  # fmt: skip
    prompt = len(final.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in final.outputs)
    usage = usage_info(prompt, completion, a.thoughts(final.outputs))
    return ChatCompletionResponse(
        id=a.request_id, model=a.model, system_fingerprint=a.fingerprint, choices=choices, usage=usage,
        prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs) if req.prompt_logprobs is not None else None,
        prompt_token_ids=final.prompt_token_ids if ids else None,
    )  # fmt: skip


async def _stream(a: _Answer, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """Each choice's message as `MessageStream` cuts it (thoughts, text, tool calls), with the logprobs
    (and with return_token_ids, the ids) of the tokens since its previous chunk."""
    req, tools = a.req, a.tools
    created = int(time.time())
    deltas = DeltaTracker()
    messages: dict[int, MessageStream] = {}
    tokens_sent: dict[int, int] = {}
    last: dict[int, object] = {}  # each choice's latest output (its reasoning tokens counted at the end)
    prompt_tokens = 0
    ids = req.return_token_ids

    def chunk(
        choices: list[ChatStreamChoice], usage: UsageInfo | None = None, prompt_ids: list[int] | None = None
    ) -> str:
        return sse(ChatCompletionChunk(id=a.request_id, created=created, model=a.model, system_fingerprint=a.fingerprint,
                                       choices=choices, usage=usage, prompt_token_ids=prompt_ids))  # fmt: skip

    async for _, out in merge_streams([stream]):
        prompt_tokens = len(out.prompt_token_ids)
        for comp in out.outputs:
            i = comp.index
            last[i] = comp
            if i not in messages:
                first = ids and not messages  # the answer's first chunk carries the prompt's ids
                messages[i], tokens_sent[i] = MessageStream(tools, a.reasoning), 0
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                              token_ids=[] if ids else None)],
                            prompt_ids=out.prompt_token_ids if first else None)  # fmt: skip
            if deltas.next(i, comp) is None:
                continue
            step = messages[i].step(comp.text, comp.finish_reason)
            if step is None:
                if (tools is not None and tools.mode != "none") or a.reasoning is not None:
                    continue  # text held back: its tokens' logprobs go with the next chunk
                step = (None, None, [], None)  # a token without text of its own: a chunk still, as vLLM sends
            thought, content, calls, finish = step
            logprobs = (
                chat_logprobs(comp, tokens_sent[i], req.top_logprobs or 0, a.token_bytes) if req.logprobs else None
            )
            new_ids = comp.token_ids[tokens_sent[i] :] if ids else None
            tokens_sent[i] = len(comp.token_ids)
            yield chunk([ChatStreamChoice(
                index=i, delta=DeltaMessage(content=content if content is not None or calls or thought else "",
                                            reasoning=thought, reasoning_content=thought, tool_calls=calls or None),
                logprobs=logprobs, finish_reason=finish, stop_reason=comp.stop_reason, token_ids=new_ids,
            )])  # fmt: skip
    if req.stream_options and req.stream_options.include_usage:
        yield chunk([], usage_info(prompt_tokens, deltas.completion_tokens, a.thoughts(last.values())))
