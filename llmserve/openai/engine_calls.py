"""Running OpenAI requests on an engine: the context-length check, and several generate()
streams read as one (a completions request with several prompts, or n samples)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from llmserve.lora_request import LoRARequest
from llmserve.openai.errors import APIError
from llmserve.outputs import RequestOutput


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int) -> int | None:
    """OpenAI semantics: prompt plus requested completion must fit in the context."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens. Please shorten the prompt.",
            code="context_length_exceeded",
        )
    if requested is not None and requested < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if requested is not None and prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce the prompt or max_tokens.",
            code="context_length_exceeded",
            param="max_tokens",
        )
    return requested


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generate() streams, tagging each output with its stream index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # each stream's own cleanup aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)


def adapter_kwargs(lora_request: LoRARequest | None) -> dict:
    """generate()'s LoRA keyword, only when there is an adapter (an engine without LoRA takes none)."""
    return {"lora_request": lora_request} if lora_request is not None else {}
