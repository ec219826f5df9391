"""A request body size limit for the HTTP servers (ASGI middleware, no web framework).

A body over the limit is refused with 413 in OpenAI's error shape: at once when its
Content-Length says so, else as soon as the bytes received pass the limit (a chunked
upload is not read to the end). The app behind never sees such a request.
"""

from __future__ import annotations

import json

from llmserve.openai.errors import error_body

DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 128k-token prompt as token ids is about 1 MiB of JSON


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(send)
        received = 0
        started = refused = False

        async def counted_receive():
            # past the limit: answer 413 now and tell the app the client left (a web
            # framework turns an exception raised while it reads the body into a 400)
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def watched_send(message):
            nonlocal started
            if refused:
                return  # the 413 is the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, watched_send)

    async def _refuse(self, send) -> None:
        body = json.dumps(
            error_body(413, f"the request body is over {self.max_bytes} bytes", "body_too_large")
        ).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
