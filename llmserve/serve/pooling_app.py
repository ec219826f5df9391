"""`llmserve serve --task embed`: an OpenAI-compatible embedding server.

/v1/embeddings (OpenAI's API: text or token ids in, float or base64 vectors and usage out),
/v1/rerank (also /rerank and /v2/rerank, the API vLLM, Cohere and Jina share), /v1/models,
/health, /version and /metrics. Concurrent requests are batched together (`serve/batcher.py`).
The model loads in the background; until then every endpoint but /version answers 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from fastapi import Depends, FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Histogram

from llmserve import __version__
from llmserve.http_errors import install_error_handlers
from llmserve.http_limits import BodyLimit
from llmserve.openai.errors import APIError
from llmserve.openai.pooling_protocol import (
    MAX_DOCUMENTS,
    MAX_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    embedding_json,
    rerank_order,
)
from llmserve.pooling import PoolingInput, SentenceEncoder, cosine_scores
from llmserve.serve.batcher import MicroBatcher
from llmserve.serve.common import add_common_routes, background_loader
from llmserve.serve.state import ServerConfig, check_api_key, resolve_model
from llmserve.serve.text_checks import refuse_lone_surrogates

_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class PoolingMetrics:
    """vLLM's request and prompt-token names, plus the sizes of the batches run."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.success = Counter("vllm:request_success", "Finished requests.", labels + ["finished_reason"],
                               registry=self.registry).labels(model_name, "stop")  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=self.registry).labels(model_name)  # fmt: skip
        self.latency = Histogram("vllm:e2e_request_latency_seconds", "Request latency.", labels,
                                 buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)  # fmt: skip
        self.batch_inputs = Histogram("llmserve:pooling_batch_inputs", "Texts encoded per batch.", labels,
                                      buckets=_BATCH_BUCKETS, registry=self.registry).labels(model_name)  # fmt: skip
        self.batch_requests = Histogram("llmserve:pooling_batch_requests", "Requests served per batch.", labels,
                                        buckets=_BATCH_BUCKETS, registry=self.registry).labels(model_name)  # fmt: skip

    def on_batch(self, requests: int, inputs: int) -> None:
        self.batch_requests.observe(requests)
        self.batch_inputs.observe(inputs)

    def finished(self, tokens: int, started: float) -> None:
        self.success.inc()
        self.prompt_tokens.inc(tokens)
        self.latency.observe(time.perf_counter() - started)


@dataclass
class PoolingState:
    config: ServerConfig
    metrics: PoolingMetrics
    encoder: SentenceEncoder | None = None
    batcher: MicroBatcher | None = None
    startup_error: str | None = None
    draining: bool = False

    def not_ready(self) -> str | None:
        """Why requests cannot be served now; None when they can."""
        if self.draining:
            return "the server is shutting down"
        if self.encoder is None or self.batcher is None:
            return self.startup_error or "the model is still loading"
        return None

    def require_encoder(self) -> tuple[SentenceEncoder, MicroBatcher]:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if (why := self.not_ready()) is not None:
            raise APIError(503, f"the server is not ready: {why}", code="not_ready")
        return self.encoder, self.batcher

    def resolve_model(self, requested: str | None) -> str:
        return resolve_model(self.config, requested)


async def _authorized(request: Request) -> PoolingState:
    state: PoolingState = request.app.state.pooling
    check_api_key(state, request)  # reads only .config.api_key
    await refuse_lone_surrogates(request)
    return state


def build_pooling_app(
    config: ServerConfig,
    encoder_factory: Callable[[], SentenceEncoder],
    on_fatal: Callable[[str], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    state = PoolingState(config, PoolingMetrics(config.served_model_names[0]))

    def loaded(encoder: SentenceEncoder) -> None:
        # a batch holds as many texts as the encoder runs in one forward pass
        state.batcher = MicroBatcher(encoder.embed, max_items=encoder.batch_size, on_batch=state.metrics.on_batch)
        state.encoder = encoder
        if on_ready is not None:
            on_ready()

    async def stop() -> None:
        if state.batcher is not None:
            await state.batcher.close()

    app = FastAPI(title="llmserve embeddings", version=__version__,
                  lifespan=background_loader(encoder_factory, "the embedding model", state, loaded, on_fatal, stop))  # fmt: skip
    app.state.pooling = state
    install_error_handlers(app)
    add_common_routes(
        app, config, not_ready=state.not_ready, registry=lambda: state.metrics.registry,
        max_model_len=lambda: state.encoder.max_tokens if state.encoder is not None else None, authorized=_authorized,
    )  # fmt: skip

    @app.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(req: EmbeddingRequest, request: Request,
                         s: PoolingState = Depends(_authorized)) -> EmbeddingResponse:  # fmt: skip
        started = time.perf_counter()
        encoder, batcher = s.require_encoder()
        model = s.resolve_model(req.model)
        texts = _inputs(req.input, encoder)
        if req.dimensions is not None and req.dimensions != encoder.dim:
            raise APIError(400, f"this model's embeddings have {encoder.dim} dimensions; `dimensions` "
                           f"cannot change that (got {req.dimensions})", param="dimensions")  # fmt: skip
        tokens = await asyncio.to_thread(_check_lengths, encoder, texts, "input")  # off the event loop
        vectors = await batcher.submit(texts, request.is_disconnected)
        b64 = req.encoding_format == "base64"
        data = [EmbeddingData(index=i, embedding=embedding_json(v, b64)) for i, v in enumerate(vectors)]
        s.metrics.finished(tokens, started)
        return EmbeddingResponse(model=model, data=data, usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def rerank(req: RerankRequest, request: Request, s: PoolingState = Depends(_authorized)) -> RerankResponse:
        started = time.perf_counter()
        encoder, batcher = s.require_encoder()
        model = s.resolve_model(req.model)
        docs = [d.text if isinstance(d, RerankDocument) else d for d in req.documents]
        if not req.query:
            raise APIError(400, "query must be a non-empty string", param="query")
        if not docs or len(docs) > MAX_DOCUMENTS:
            raise APIError(400, f"documents must hold 1 to {MAX_DOCUMENTS} texts, got {len(docs)}", param="documents")
        if any(not d for d in docs):
            raise APIError(400, "documents must not be empty strings", param="documents")
        tokens = await asyncio.to_thread(_check_lengths, encoder, [req.query], "query")
        tokens += await asyncio.to_thread(_check_lengths, encoder, docs, "documents")
        vectors = np.stack(await batcher.submit([req.query, *docs], request.is_disconnected))
        scores = cosine_scores(vectors[0], vectors[1:])
        order = rerank_order(scores, req.top_n)
        results = [RerankResult(index=i, relevance_score=float(scores[i]),
                                document=RerankDocument(text=docs[i]) if req.return_documents else None)
                   for i in order]  # fmt: skip
        s.metrics.finished(tokens, started)
        return RerankResponse(model=model, usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
                              results=results)  # fmt: skip

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path, response_model=RerankResponse, response_model_exclude_none=True)(rerank)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_body_bytes)
    return app


def _inputs(value: str | list, encoder: SentenceEncoder) -> list[PoolingInput]:
    """The texts, or token-id rows (one list of ints, or a list of them: embedded exactly as
    given, as OpenAI's API takes them), of an embeddings request."""
    items = [value] if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)) else value
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(items)} inputs; at most {MAX_INPUTS} per request", param="input")
    if any(not t for t in items):
        raise APIError(400, "input must not contain empty strings or empty token-id lists", param="input")
    for i, row in enumerate(items):
        if not isinstance(row, str) and (why := encoder.refuse_ids(row)) is not None:
            raise APIError(400, f"input[{i}]: {why}", param="input")
    return items


def _check_lengths(encoder: SentenceEncoder, texts: list[PoolingInput], param: str) -> int:
    """Total tokens; a text longer than the model takes is refused, never silently cut."""
    counts = encoder.token_counts(texts)
    for i, n in enumerate(counts):
        if n > encoder.max_tokens:
            where = f"{param}[{i}]" if len(texts) > 1 or param != "query" else param
            raise APIError(400, f"{where} is {n} tokens long; this model takes at most {encoder.max_tokens}",
                           param=param)  # fmt: skip
    return sum(counts)
