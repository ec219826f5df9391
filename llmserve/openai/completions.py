"""Completions: one engine request per prompt (and n samples each), the answer as a body or
a stream (`Reply`), with no web framework."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.engine.protocol import EngineClient
from llmserve.lora_request import LoRARequest
from llmserve.openai.engine_calls import adapter_kwargs, merge_streams, resolve_max_tokens
from llmserve.openai.errors import APIError
from llmserve.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from llmserve.openai.reply import Reply
from llmserve.openai.streaming import DeltaTracker, sse, sse_stream


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [p]  # one prompt of token ids
    return list(p)


def completion_logprobs(out: CompletionOutput, start: int, text_offset: int) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    offset = text_offset
    for token, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        chosen = entry[token]
        tok = chosen.decoded_token or ""
        lp.tokens.append(tok)
        lp.token_logprobs.append(chosen.logprob)
        lp.top_logprobs.append({(e.decoded_token or ""): e.logprob for e in entry.values()})
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


async def completion(engine: EngineClient, req: CompletionRequest, model: str,
                     lora_request: LoRARequest | None = None) -> Reply:  # fmt: skip
    """Start the request's prompts on `engine` (with a LoRA adapter if given); `model` is the
    name the answer carries. Raises APIError for what is wrong with the request before
    anything runs."""
    arrival = time.time()  # TTFT and latency count tokenization too
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
    prompts = _prompts(req)
    max_len = engine.model_config.max_model_len
    tokenized = []
    vocab = engine.model_config.arch.vocab_size
    # off the event loop: a long prompt takes seconds to tokenize (the tokenizer lets go of the GIL)
    encoded = await asyncio.to_thread(lambda: [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts])
    for p, ids in zip(prompts, encoded):
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        resolve_max_tokens(len(ids), req.max_tokens, max_len)
        text = p if isinstance(p, str) else engine.tokenizer.decode(ids) if req.echo else None  # echo shows it
        tokenized.append((text, ids))
    params = req.to_sampling_params(req.max_tokens)
    await engine.check_params(params)  # before a stream starts: a bad spec is a 400, not an error event
    request_id = random_id("cmpl")
    streams = [
        engine.generate({"prompt_token_ids": ids, "prompt": text}, params, f"{request_id}-{i}", req.priority, arrival,
                        **adapter_kwargs(lora_request))
        for i, (text, ids) in enumerate(tokenized)
    ]
    if req.stream:
        return Reply(events=sse_stream(_stream(req, model, request_id, streams)))

    async def body() -> dict:
        return _response(req, model, request_id, await _collect(streams)).model_dump()

    return Reply(body=body())


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, out in merge_streams(streams):
        finals[i] = out
    return [finals[i] for i in range(len(streams))]


def _response(req: CompletionRequest, model: str, request_id: str, finals: list[RequestOutput]) -> CompletionResponse:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, final in enumerate(finals):
        prompt_tokens += len(final.prompt_token_ids)
        prefix = (final.prompt or "") if req.echo else ""
        for out in final.outputs:
            completion_tokens += len(out.token_ids)
            logprobs = completion_logprobs(out, 0, len(prefix)) if req.logprobs is not None else None
            choices.append(
                CompletionChoice(
                    index=i * req.n + out.index, text=prefix + out.text, logprobs=logprobs,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                )
            )  # fmt: skip
    usage = UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )  # fmt: skip
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


async def _stream(
    req: CompletionRequest, model: str, request_id: str, streams: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[str]:
    created = int(time.time())
    deltas = DeltaTracker()
    prompt_tokens: dict[int, int] = {}

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> str:
        body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return sse(body)

    async for i, out in merge_streams(streams):
        if i not in prompt_tokens:
            prompt_tokens[i] = len(out.prompt_token_ids)
            if req.echo:
                for j in range(req.n):
                    yield chunk([{"index": i * req.n + j, "text": out.prompt or "", "logprobs": None, "finish_reason": None}])
        for comp in out.outputs:
            delta = deltas.next((i, comp.index), comp)
            if delta is None:
                continue
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(comp, delta.token_from, delta.text_from).model_dump()
            yield chunk([{
                "index": i * req.n + comp.index, "text": delta.text, "logprobs": logprobs,
                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
            }])  # fmt: skip
    if req.stream_options and req.stream_options.include_usage:
        total_prompt = sum(prompt_tokens.values())
        usage = UsageInfo(
            prompt_tokens=total_prompt, completion_tokens=deltas.completion_tokens,
            total_tokens=total_prompt + deltas.completion_tokens,
        )  # fmt: skip
        yield chunk([], usage)
