"""The Responses API's routes on `llmserve serve` (llmserve/responses does the work):

- POST /v1/responses: create (a body, a stream of typed events, or a background run);
- GET /v1/responses/{id}, DELETE /v1/responses/{id};
- GET /v1/responses/{id}/input_items (after, limit, order);
- POST /v1/responses/{id}/cancel (a background response).

Stored responses belong to the API key that made them: another key (the server may take several:
`--api-key K1 --api-key K2`) gets a 404 for them, as for an id that does not exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request

from llmserve.responses.items import ResponsesRequest
from llmserve.responses.service import Responses
from llmserve.responses.storage import open_store
from llmserve.responses.store import default_store_path, namespace_of
from llmserve.serve.state import ServerState, bearer_token


def make_responses(state: ServerState) -> Responses:
    config = state.config
    path = config.responses_store or default_store_path()
    return Responses(lambda: open_store(path, config.responses_max_count, config.responses_max_age_s),
                     config.tool_call_parser, config.reasoning_parser, config.request_timeout_s)  # fmt: skip


def add_responses_routes(app: FastAPI, responses: Responses, authorized: Callable[..., Any],
                         respond: Callable[..., Any]) -> None:  # fmt: skip
    """The routes over `responses`; `authorized` is the app's key check, `respond` sends a Reply."""

    def namespace(s: ServerState, request: Request) -> str:
        return namespace_of(bearer_token(request) if s.config.api_key is not None else None)

    @app.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request, s: ServerState = Depends(authorized)):
        engine, model = s.require_engine(), s.resolve_model(req.model)
        reply = await responses.create(req, model, namespace(s, request), responses.runner(engine, s.adapter(model)))
        return await respond(request, reply)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request, s: ServerState = Depends(authorized)) -> dict:
        return await responses.retrieve(namespace(s, request), response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request, s: ServerState = Depends(authorized)) -> dict:
        return await responses.delete(namespace(s, request), response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request, s: ServerState = Depends(authorized)) -> dict:
        return await responses.cancel(namespace(s, request), response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, after: str | None = None, limit: int = 20,
                          order: str = "desc", s: ServerState = Depends(authorized)) -> dict:  # fmt: skip
        return await responses.input_items(namespace(s, request), response_id, after, limit, order)
