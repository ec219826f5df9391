"""A stub OpenAI completions server that streams like an engine, to measure what the
benchmark client (and HTTP) add to TTFT and ITL: one global tick every --tick-ms releases
one token to every active stream, and a new request's first token comes two ticks after it
arrives (as if one prefill step ran). Against it, `llmserve bench serve` should see TTFT
between one and two ticks and ITL of one tick; anything more is the client's and HTTP's.

    python scripts/stub_openai_server.py --port 8312 &
    llmserve bench serve --base-url http://127.0.0.1:8312 --num-prompts 400 --input-len 512 \\
        --output-len 256 --ignore-eos --request-rate 16 --vocab-size 128256
"""

from __future__ import annotations

import argparse
import asyncio
import json
from contextlib import asynccontextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def build(tick_s: float) -> Starlette:
    waiters: list[asyncio.Future] = []

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick_s)
            ready, waiters[:] = waiters[:], []
            for fut in ready:
                if not fut.done():
                    fut.set_result(None)

    async def tick() -> None:
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        await fut

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        prompt_len = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1

        async def stream():
            await tick()  # the prefill step
            for i in range(n):
                await tick()
                choice = {"index": 0, "text": " a", "logprobs": None, "finish_reason": "length" if i == n - 1 else None}
                yield "data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                                             "choices": [choice]}) + "\n\n"  # fmt: skip
            usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
            yield "data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                                         "choices": [], "usage": usage}) + "\n\n"  # fmt: skip
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(ticker())
        yield
        task.cancel()

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8312)
    p.add_argument("--tick-ms", type=float, default=6.5, help="one decode step (default: the 8B shape's on the H200)")
    args = p.parse_args()
    uvicorn.run(build(args.tick_ms / 1000), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
