"""OpenAI requests checked before they become Triton requests (a `BadRequest` is a 400).

The same schemas as `llmserve serve` (serve/protocol.py, serve/pooling_protocol.py) read the
request, so a field of the wrong type is refused here as it is there; then what a Triton
model cannot do is refused by name instead of being dropped without a word (n > 1,
logprobs, echo, ...), and every number sent on fits Triton's 64-bit parameters. (Text Triton
could not carry as UTF-8, a lone surrogate, is refused earlier, for the whole body: app.py.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import ValidationError

from llmserve.openai.pooling_protocol import MAX_DOCUMENTS, MAX_INPUTS, EmbeddingRequest, RerankRequest
from llmserve.openai.protocol import ChatCompletionRequest, CompletionRequest

INT64 = (-(1 << 63), (1 << 63) - 1)
# OpenAI/vLLM sampling fields a Triton chat model takes (request parameters of the chat model)
SAMPLING_INTS = ("max_tokens", "top_k", "seed", "min_tokens")
SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class BadRequest(Exception):
    """The request cannot be put to a Triton model (400)."""


def _validated(model, payload: dict):
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BadRequest(f"{where}: {first['msg']}"[:500] if where else first["msg"][:500]) from None


@dataclass
class EmbeddingsCall:
    texts: list[str]
    base64: bool
    dimensions: int | None


def embeddings_call(payload: dict) -> EmbeddingsCall:
    req = _validated(EmbeddingRequest, payload)
    texts = [req.input] if isinstance(req.input, str) else req.input
    if not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("input must be a string or a non-empty list of strings (a Triton embedding model "
                         "takes text, not token ids)")  # fmt: skip
    if len(texts) > MAX_INPUTS:
        raise BadRequest(f"input holds {len(texts)} texts; at most {MAX_INPUTS} per request")
    return EmbeddingsCall(texts, req.encoding_format == "base64", req.dimensions)


@dataclass
class RerankCall:
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool


def rerank_call(payload: dict) -> RerankCall:
    req = _validated(RerankRequest, payload)
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    if not docs or len(docs) > MAX_DOCUMENTS:
        raise BadRequest(f"documents must hold 1 to {MAX_DOCUMENTS} texts, got {len(docs)}")
    return RerankCall(req.query, docs, req.top_n, req.return_documents)


def _unsupported(req, chat: bool) -> list[str]:
    """Fields set to something a Triton chat model cannot do (a chat request may carry
    completions' fields along: extra fields, read the same way)."""
    found = []
    if req.n != 1:
        found.append("n > 1")
    if req.stop_token_ids:
        found.append("stop_token_ids")
    if req.include_stop_str_in_output:
        found.append("include_stop_str_in_output")
    if not req.skip_special_tokens:
        found.append("skip_special_tokens = false")
    if (req.logprobs or req.top_logprobs) if chat else req.logprobs is not None:
        found.append("logprobs")
    found += [name for name in ("echo", "suffix") if getattr(req, name, None)]
    if getattr(req, "best_of", None) not in (None, 1):
        found.append("best_of")
    return found


def text_prompt(req: CompletionRequest) -> str:
    """A completions request's one text prompt (a string, or a list holding one)."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("a Triton chat model takes one text prompt")
    return prompt


def generation_request(payload: dict, chat: bool) -> ChatCompletionRequest | CompletionRequest:
    """The request as the API server reads it; BadRequest for what Triton cannot take."""
    req = _validated(ChatCompletionRequest if chat else CompletionRequest, payload)
    if unsupported := _unsupported(req, chat):
        raise BadRequest(f"not supported by Triton chat models: {', '.join(unsupported)}")
    return req


def sampling_parameters(req: ChatCompletionRequest | CompletionRequest) -> dict:
    """The request's sampling fields as Triton request parameters (64-bit ints, finite doubles)."""
    values = {name: getattr(req, name) for name in SAMPLING_INTS + SAMPLING_FLOATS}
    values["max_tokens"] = req.requested_max_tokens() if isinstance(req, ChatCompletionRequest) else req.max_tokens
    params: dict = {}
    for name, value in values.items():
        if value is None or (name in ("min_tokens", "presence_penalty", "frequency_penalty") and not value):
            continue  # unset (or the default): the model's own default
        if name in SAMPLING_INTS and not INT64[0] <= value <= INT64[1]:
            raise BadRequest(f"{name} is out of range: {value}")
        if name in SAMPLING_FLOATS and not math.isfinite(value):
            raise BadRequest(f"{name} must be a finite number")
        params[name] = value
    if req.ignore_eos:
        params["ignore_eos"] = True
    return params
