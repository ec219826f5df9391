"""Embeddings and rerank requests checked before they become Triton requests (a `BadRequest`
is a 400), by the same schemas as `llmserve serve --task embed` (openai/pooling_protocol.py).
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
