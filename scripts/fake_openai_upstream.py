"""A fast fake OpenAI upstream for the gateway-overhead benchmark only: a fixed completion, no model.

Raw ASGI (no framework), so the gateway's cost is what the benchmark sees:
    uvicorn fake_openai_upstream:app --app-dir scripts --port 9000 --no-access-log
"""

from __future__ import annotations

import json

COMPLETION = json.dumps({
    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
    "choices": [{"index": 0, "text": " a fixed answer", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8},
}).encode()  # fmt: skip
HEADERS = [(b"content-type", b"application/json")]


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:  # read the whole body before answering
        more = (await receive()).get("more_body", False)
    body = b'{"status":"ok"}' if scope["path"] == "/health" else COMPLETION
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": body})
