"""Server-sent events: one `data:` line per chunk, errors as a final event, then [DONE]."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass

from pydantic import BaseModel

from llmserve.errors import EngineDeadError
from llmserve.openai.errors import APIError, sse_error
from llmserve.outputs import CompletionOutput

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
    except EngineDeadError as exc:
        yield sse_error(503, str(exc), "engine_dead")
    except ValueError as exc:
        yield sse_error(400, str(exc))
    except Exception as exc:  # noqa: BLE001 - the stream must end cleanly
        logger.exception("error during a stream")
        yield sse_error(500, f"internal error: {type(exc).__name__}")
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


@dataclass(slots=True)
class Delta:
    text: str  # text not yet sent
    text_from: int  # where it starts in the cumulative text
    token_from: int  # index of the first token not yet sent


class DeltaTracker:
    """Turns cumulative outputs into per-choice deltas; a finished choice is sent once."""

    def __init__(self) -> None:
        self._sent: dict[Hashable, tuple[int, int]] = {}  # key -> (chars, tokens) sent
        self._finished: set[Hashable] = set()
        self.completion_tokens = 0

    def next(self, key: Hashable, comp: CompletionOutput) -> Delta | None:
        """What to send for this choice now, or None when there is nothing new."""
        if key in self._finished:
            return None
        text_from, token_from = self._sent.get(key, (0, 0))
        text = comp.text[text_from:]
        if not text and len(comp.token_ids) == token_from and comp.finish_reason is None:
            return None
        if comp.finish_reason is not None:
            self._finished.add(key)
        self._sent[key] = (len(comp.text), len(comp.token_ids))
        self.completion_tokens += len(comp.token_ids) - token_from
        return Delta(text, text_from, token_from)
