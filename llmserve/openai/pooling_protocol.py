"""Request and response schemas of the embedding server: OpenAI's /v1/embeddings, and
the rerank API that vLLM, Cohere and Jina share (/v1/rerank)."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from llmserve.openai.protocol import OpenAIModel

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request
MAX_DOCUMENTS = 1000


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{uuid.uuid4().hex}")
    model: str
    created: int = Field(default_factory=lambda: int(time.time()))
    usage: PoolingUsage
    results: list[RerankResult]


def embedding_json(vector: Sequence[float], b64: bool) -> list[float] | str:
    """One embedding as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if b64:
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return [float(x) for x in vector]


def rerank_order(scores: Sequence[float], top_n: int | None) -> list[int]:
    """Document indices, best score first, the first `top_n` (all when None)."""
    return sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:top_n]
