"""Server-sent events: one `data:` line per chunk, errors as a final event, then [DONE]."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from pydantic import BaseModel

from llmserve.engine.core_client import EngineDeadError
from llmserve.serve.errors import APIError, sse_error

logger = logging.getLogger(__name__)


def sse(body: dict | BaseModel) -> str:
    data = body.model_dump_json(exclude_none=False) if isinstance(body, BaseModel) else json.dumps(body)
    return f"data: {data}\n\n"


async def sse_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wrap a chunk stream: an error mid-stream becomes an error event; always [DONE].

    If the client disconnects, the response task is cancelled; the cancellation runs
    through `chunks`, whose generate() streams abort their requests."""
    try:
        async for chunk in chunks:
            yield chunk
    except asyncio.CancelledError:
        raise
    except APIError as exc:
        yield sse_error(exc.status, exc.message)
    except (ValueError, EngineDeadError) as exc:
        yield sse_error(503 if isinstance(exc, EngineDeadError) else 400, str(exc))
    except Exception as exc:  # noqa: BLE001 - the stream must end cleanly
        logger.exception("error during a stream")
        yield sse_error(500, f"internal error: {type(exc).__name__}")
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"
