"""Embeddings and rerank requests checked before they become Triton requests (a `BadRequest`
is a 400), by the same schemas as `llmserve serve --task embed` (openai/pooling_protocol.py).
Embeddings take text or token ids; an id past the model's vocabulary is the model's to refuse
(the gateway does not know the vocabulary): also a 400.
Chat and completions need no such step: the chat model reads the OpenAI body itself, with
the API server's own code. (Text Triton could not carry as UTF-8, a lone surrogate, is
refused earlier, for the whole body: intake.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from llmserve.openai.pooling_protocol import MAX_DOCUMENTS, MAX_INPUTS, EmbeddingRequest, RerankRequest


class BadRequest(Exception):
    """The request cannot be put to a Triton model (400)."""


def _validated(model, payload: dict):
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BadRequest(f"{where}: {first['msg']}"[:500] if where else first["msg"][:500]) from None


MAX_TOKEN_ID = 2**31 - 1  # past any vocabulary: refused here, so it never overflows a tensor


@dataclass
class EmbeddingsCall:
    """What to embed: `texts`, or token-id rows (`token_ids`, embedded exactly as given); the
    other is empty."""

    texts: list[str]
    token_ids: list[list[int]]
    base64: bool
    dimensions: int | None


def _token_rows(value: list) -> list[list[int]] | None:
    """The token-id rows of an `input` of token ids (one list of ints, or a list of them);
    None for text input."""
    if value and all(isinstance(t, int) for t in value):
        return [value]
    if value and all(isinstance(t, list) for t in value):
        return value
    return None


def embeddings_call(payload: dict) -> EmbeddingsCall:
    req = _validated(EmbeddingRequest, payload)
    value = [req.input] if isinstance(req.input, str) else req.input
    rows = _token_rows(value)
    if not value:
        raise BadRequest("input must not be empty: give a string, a list of strings, or token ids")
    if len(rows if rows is not None else value) > MAX_INPUTS:
        raise BadRequest(f"input holds {len(rows or value)} inputs; at most {MAX_INPUTS} per request")
    for i, row in enumerate(rows or []):
        if not row:
            raise BadRequest(f"input[{i}] holds no token ids")
        bad = next((t for t in row if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            why = "token ids are 0 or more" if bad < 0 else "past any vocabulary"
            raise BadRequest(f"input[{i}] holds {bad}, not a token id ({why})")
    texts = [] if rows is not None else value
    return EmbeddingsCall(texts, rows or [], req.encoding_format == "base64", req.dimensions)


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
