"""Completions: one engine request per prompt (and n samples each), the answer as a body or
a stream (`Reply`), with no web framework."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llmserve.engine.detokenizer import stable_prompt_text
from llmserve.engine.protocol import EngineClient
from llmserve.lora_request import LoRARequest
from llmserve.openai.engine_calls import adapter_kwargs, merge_streams, resolve_max_tokens
from llmserve.openai.errors import APIError
from llmserve.openai.fingerprint import system_fingerprint
from llmserve.openai.logprobs import TextOffsets, completion_logprobs, prompt_logprobs_json
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
from llmserve.openai.token_bytes import TokenBytes, token_bytes_of
from llmserve.outputs import CompletionOutput, RequestOutput


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [p]  # one prompt of token ids
    return list(p)


@dataclass(frozen=True, slots=True)
class _Answer:
    """What every choice and chunk of one completions answer is made with."""

    req: CompletionRequest
    model: str
    request_id: str
    fingerprint: str
    token_bytes: TokenBytes

    def offsets(self, final: RequestOutput) -> TextOffsets:
        """A choice's text offsets: from 0 with echo (its prompt's tokens come first), else after the prompt."""
        if self.req.echo:
            return TextOffsets(self.token_bytes)
        return TextOffsets(self.token_bytes, 0, final.prompt_token_ids[-3:])

    def prompt_logprobs(self, final: RequestOutput, offsets: TextOffsets) -> CompletionLogprobs:
        """The logprobs of an echoed prompt's tokens (the first has none)."""
        ids = final.prompt_token_ids
        return completion_logprobs(ids, final.prompt_logprobs or [None] * len(ids), offsets)

    @staticmethod
    def logprobs(out: CompletionOutput, start: int, offsets: TextOffsets) -> CompletionLogprobs:
        """The logprobs of `out`'s tokens from `start`."""
        return completion_logprobs(out.token_ids[start:], (out.logprobs or [])[start:], offsets)


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
    encoded = await asyncio.to_thread(
        lambda: [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    )
    for p, ids in zip(prompts, encoded):
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        resolve_max_tokens(len(ids), req.max_tokens, max_len)
        # echo shows the prompt: token ids' text to their last whole character (the output completes one cut short)
        text = p if isinstance(p, str) else stable_prompt_text(engine.tokenizer.decode(ids)) if req.echo else None
        tokenized.append((text, ids))
    params = req.to_sampling_params(req.max_tokens)
    await engine.check_params(params)  # before a stream starts: a bad spec is a 400, not an error event
    request_id = random_id("cmpl")
    answer = _Answer(req, model, request_id, system_fingerprint(engine, lora_request), token_bytes_of(engine.tokenizer))
    streams = [
        engine.generate(
            {"prompt_token_ids": ids, "prompt": text},
            params,
            f"{request_id}-{i}",
            req.priority,
            arrival,
            **adapter_kwargs(lora_request),
        )
        for i, (text, ids) in enumerate(tokenized)
    ]
    if req.stream:
        return Reply(events=sse_stream(_stream(answer, streams)))

    async def body() -> dict:
        return _response(answer, await _collect(streams)).model_dump()

    return Reply(body=body())


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, out in merge_streams(streams):
        finals[i] = out
    return [finals[i] for i in range(len(streams))]


def _response(a: _Answer, finals: list[RequestOutput]) -> CompletionResponse:
    req = a.req
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, final in enumerate(finals):
        prompt_tokens += len(final.prompt_token_ids)
        prefix = (final.prompt or "") if req.echo else ""
        for out in final.outputs:
            completion_tokens += len(out.token_ids)
            logprobs = None
            if req.logprobs is not None:
                offsets = a.offsets(final)
                echoed = a.prompt_logprobs(final, offsets) if req.echo else None  # the prompt's first, as OpenAI's
                logprobs = a.logprobs(out, 0, offsets)
                if echoed is not None:
                    logprobs = CompletionLogprobs(**{k: getattr(echoed, k) + getattr(logprobs, k)
                                                     for k in CompletionLogprobs.model_fields})  # fmt: skip
            choices.append(
                CompletionChoice(
                    index=i * req.n + out.index, text=prefix + out.text, logprobs=logprobs,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs) if req.prompt_logprobs is not None else None,
                    prompt_token_ids=final.prompt_token_ids if req.return_token_ids else None,
                    token_ids=out.token_ids if req.return_token_ids else None,
                )
            )  # fmt: skip
    usage = UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )  # fmt: skip
    return CompletionResponse(id=a.request_id, model=a.model, system_fingerprint=a.fingerprint, choices=choices,
                              usage=usage)  # fmt: skip


async def _stream(a: _Answer, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    req = a.req
    created = int(time.time())
    deltas = DeltaTracker()
    prompt_tokens: dict[int, int] = {}
    started: set[int] = set()  # choices whose first chunk went (with return_token_ids: the prompt's ids in it)
    offsets: dict[int, TextOffsets] = {}  # each choice's, from chunk to chunk

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> str:
        body = {"id": a.request_id, "object": "text_completion", "created": created, "model": a.model,
                "system_fingerprint": a.fingerprint, "choices": choices}  # fmt: skip
        if usage is not None:
            body["usage"] = usage.model_dump()
        return sse(body)

    def choice(index: int, out: RequestOutput, text: str, logprobs: CompletionLogprobs | None, token_ids: list[int],
               **rest) -> dict:  # fmt: skip
        body = {
            "index": index,
            "text": text,
            "logprobs": logprobs.model_dump() if logprobs is not None else None,
            **rest,
        }
        if req.return_token_ids:
            if index not in started:
                body["prompt_token_ids"] = out.prompt_token_ids
            body["token_ids"] = token_ids
        started.add(index)
        return body

    async for i, out in merge_streams(streams):
        if i not in prompt_tokens:
            prompt_tokens[i] = len(out.prompt_token_ids)
            for j in range(req.n):
                echoed = None
                if req.logprobs is not None:
                    offsets[i * req.n + j] = a.offsets(out)
                    echoed = a.prompt_logprobs(out, offsets[i * req.n + j]) if req.echo else None
                if req.echo:
                    yield chunk([choice(i * req.n + j, out, out.prompt or "", echoed, [], finish_reason=None)])
        for comp in out.outputs:
            delta = deltas.next((i, comp.index), comp)
            if delta is None:
                continue
            index = i * req.n + comp.index
            logprobs = a.logprobs(comp, delta.token_from, offsets[index]) if req.logprobs is not None else None
            yield chunk([choice(index, out, delta.text, logprobs, comp.token_ids[delta.token_from :],
                                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)])  # fmt: skip
    if req.stream_options and req.stream_options.include_usage:
        total_prompt = sum(prompt_tokens.values())
        usage = UsageInfo(
            prompt_tokens=total_prompt, completion_tokens=deltas.completion_tokens,
            total_tokens=total_prompt + deltas.completion_tokens,
        )  # fmt: skip
        yield chunk([], usage)
