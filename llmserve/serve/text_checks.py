"""The server's check of a request body for lone UTF-16 surrogates (llmserve/openai/text_checks.py)."""

from __future__ import annotations

from fastapi import Request

from llmserve.openai.errors import APIError
from llmserve.openai.text_checks import LONE_SURROGATE, has_lone_surrogate


async def refuse_lone_surrogates(request: Request) -> None:
    """A route dependency: 400 for a body with a lone surrogate (FastAPI keeps the body read)."""
    if request.method == "POST" and has_lone_surrogate(await request.body()):
        raise APIError(400, LONE_SURROGATE)
