"""What an OpenAI call answers, with no web framework: a JSON body, or server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from llmserve.openai.errors import APIError, error_body


@dataclass
class Reply:
    """`body`: the whole answer, still being made (await it); `events`: a stream of `data: ...`
    lines, each ending with a blank line, the last `data: [DONE]` (an error midway is sent as
    an error event before it); `error`: a refusal, already in OpenAI's shape."""

    status: int = 200
    body: Awaitable[dict] | None = None
    events: AsyncIterator[str] | None = None
    error: dict | None = None

    @classmethod
    def refused(cls, exc: APIError) -> Reply:
        return cls(status=exc.status, error=error_body(exc.status, exc.message, exc.code, exc.param))
