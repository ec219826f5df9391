"""Request and response schemas of the embedding server: OpenAI's /v1/embeddings, and
the rerank API that vLLM, Cohere and Jina share (/v1/rerank)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from llmserve.serve.protocol import OpenAIModel

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
