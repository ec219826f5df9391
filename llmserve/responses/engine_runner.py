"""The Responses API's chat path on an engine (`llmserve serve`): a response's chat request planned
as /v1/chat/completions plans it (`plan_chat`: template, sampling, tools, reasoning parser,
grammar), run on the engine, its output cut by `MessageStream` into the pieces service.py makes
items of. Apart from service.py, which the gateway imports without the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from llmserve.engine.protocol import EngineClient
from llmserve.lora_request import LoRARequest
from llmserve.openai.chat import ChatPlan, MessageStream, plan_chat, reasoning_tokens
from llmserve.openai.engine_calls import adapter_kwargs
from llmserve.openai.protocol import ChatCompletionRequest
from llmserve.outputs import RequestOutput
from llmserve.responses.service import ChatRun, Ended, Piece, Runner, response_usage


def engine_runner(engine: EngineClient, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                  lora_request: LoRARequest | None = None) -> Runner:  # fmt: skip
    """Chat requests run on `engine` as /v1/chat/completions runs them (`plan_chat`), the output
    cut by `MessageStream`."""

    async def run(chat: ChatCompletionRequest, rid: str) -> ChatRun:
        plan = await plan_chat(engine, chat, tool_call_parser, reasoning_parser)
        stream = engine.generate({"prompt_token_ids": plan.ids}, plan.params, rid, chat.priority, plan.arrival,
                                 **adapter_kwargs(lora_request))  # fmt: skip
        return ChatRun(_engine_pieces(engine, plan, stream), plan.ids)

    return run


async def _engine_pieces(engine: EngineClient, plan: ChatPlan,
                         stream: AsyncIterator[RequestOutput]) -> AsyncIterator[Piece | Ended]:  # fmt: skip
    message = MessageStream(plan.tools, plan.thinking)
    last: RequestOutput | None = None
    async with aclosing(stream):
        async for out in stream:
            last, comp = out, out.outputs[0]
            step = message.step(comp.text, comp.finish_reason)
            if step is not None:
                thought, content, calls, _ = step
                yield Piece(thought or "", content or "", list(calls))
    comp = last.outputs[0]
    thoughts = reasoning_tokens(engine.tokenizer, comp.token_ids, comp.text, plan.thinking) or 0
    usage = response_usage(len(last.prompt_token_ids), len(comp.token_ids), thoughts, last.num_cached_tokens)
    yield Ended(comp.finish_reason == "length", usage)
