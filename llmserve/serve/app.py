"""The FastAPI app: thin routes over the serving functions; no engine state of its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmserve import __version__
from llmserve.engine.protocol import EngineClient
from llmserve.http_errors import install_error_handlers
from llmserve.http_limits import BodyLimit
from llmserve.metrics import EngineMetrics
from llmserve.openai.chat import chat_completion, render_chat
from llmserve.openai.completions import completion
from llmserve.openai.deadline import effective_timeout, with_deadline
from llmserve.openai.errors import APIError
from llmserve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from llmserve.openai.reply import Reply
from llmserve.openai.tools import template_messages, template_tools
from llmserve.serve.common import add_common_routes, background_loader
from llmserve.serve.lora_routes import add_lora_routes
from llmserve.serve.responses_routes import add_responses_routes, make_responses
from llmserve.serve.state import (
    ServerConfig,
    ServerState,
    check_admin_key,
    check_api_key,
    get_state,
    run_until_disconnect,
)
from llmserve.serve.text_checks import refuse_lone_surrogates
from llmserve.serve.timing_log import RequestTimingLog

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], EngineClient]
ENGINE_DEATH_GRACE_S = 2.0  # from a dead engine core to the server's exit


async def _authorized(request: Request) -> ServerState:
    state = get_state(request)
    check_api_key(state, request)
    await refuse_lone_surrogates(request)
    return state


async def _admin(request: Request) -> ServerState:
    state = get_state(request)
    check_admin_key(state, request)
    return state


async def respond(request: Request, reply: Reply):
    """The OpenAI layer's answer over HTTP: a stream as server-sent events, a body as JSON once
    made (abandoned, and its engine requests aborted, if the client leaves first)."""
    if reply.events is not None:
        return StreamingResponse(reply.events, media_type="text/event-stream")
    return JSONResponse(await run_until_disconnect(request, reply.body))


def build_app(
    config: ServerConfig,
    engine_factory: EngineFactory,
    on_fatal: Callable[[str], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The app starts serving at once; the engine loads in the background (503 until then).
    `on_fatal` is called if the engine cannot start, `on_ready` once it has. An unwritable
    `config.request_timing_log` raises OSError here."""
    state = ServerState(config)
    responses = make_responses(state)
    timing_log = RequestTimingLog(config.request_timing_log) if config.request_timing_log else None

    def died(reason: str) -> None:
        """The engine core died: /health is 503 already and the requests in flight end with
        the reason; after a short grace (their error events reach the clients) the server
        stops with exit status 1, so its supervisor restarts it with a fresh core."""
        logger.error("engine core died (%s): stopping in %.0f s", reason, ENGINE_DEATH_GRACE_S)
        if on_fatal is not None:
            asyncio.get_running_loop().call_later(ENGINE_DEATH_GRACE_S, on_fatal, f"the engine core died: {reason}")

    def loaded(engine: EngineClient) -> None:
        engine.add_death_listener(died)
        state.metrics = EngineMetrics(engine, config.served_model_names[0])
        if timing_log is not None:
            engine.add_stats_listener(timing_log.observe)
        state.engine = engine
        if on_ready is not None:
            on_ready()
        logger.info("engine ready: serving %s", ", ".join(config.served_model_names))

    async def stop() -> None:
        await responses.close()  # background responses stopped (stored as cancelled) before the engine
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        if timing_log is not None:
            timing_log.close()

    app = FastAPI(title="llmserve", version=__version__,
                  lifespan=background_loader(engine_factory, "engine", state, loaded, on_fatal, stop))  # fmt: skip
    app.state.server = state
    install_error_handlers(app)
    add_common_routes(
        app, config,
        not_ready=lambda: None if state.ready else (state.startup_error or "not ready"),
        registry=lambda: state.metrics.registry if state.metrics else None,
        max_model_len=lambda: state.engine.model_config.max_model_len if state.engine else None,
        authorized=_authorized,
        adapters=lambda: state.adapters,
    )  # fmt: skip

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request, s: ServerState = Depends(_authorized)):
        engine, model = s.require_engine(), s.resolve_model(req.model)
        reply = await completion(engine, req, model, s.adapter(model))
        return await respond(
            request, with_deadline(reply, effective_timeout(req.request_timeout_s, s.config.request_timeout_s))
        )

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request, s: ServerState = Depends(_authorized)):
        engine, model = s.require_engine(), s.resolve_model(req.model)
        reply = await chat_completion(engine, req, model, s.config.tool_call_parser, s.adapter(model),
                                      s.config.reasoning_parser)  # fmt: skip
        return await respond(
            request, with_deadline(reply, effective_timeout(req.request_timeout_s, s.config.request_timeout_s))
        )

    add_responses_routes(app, responses, _authorized, respond)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest, s: ServerState = Depends(_authorized)) -> TokenizeResponse:
        engine = s.require_engine()
        s.resolve_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages")
        if req.messages is not None:  # (off the event loop, as in the generation routes)
            tools = template_tools(req.tools) if req.tools else None
            ids = await asyncio.to_thread(render_chat, engine.tokenizer, template_messages(req.messages),
                                          req.add_generation_prompt, req.chat_template_kwargs, tools)  # fmt: skip
        else:
            ids = await asyncio.to_thread(
                engine.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens
            )
        return TokenizeResponse(count=len(ids), max_model_len=engine.model_config.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest, s: ServerState = Depends(_authorized)) -> DetokenizeResponse:
        engine = s.require_engine()
        s.resolve_model(req.model)
        vocab = engine.model_config.arch.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))

    if config.enable_sleep_mode:
        add_sleep_routes(app)
    if config.enable_lora:
        if config.enable_runtime_lora_updating:
            add_lora_routes(app, _admin)
        for name, path in config.lora_modules.items():  # checked by `serve` before the app starts
            state.add_adapter(name, path)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_body_bytes)
    return app


def add_sleep_routes(app: FastAPI) -> None:
    """vLLM's sleep-mode routes: an idle engine gives its device memory back until woken (by
    POST /wake_up, or by the next request, which waits for it)."""

    @app.post("/sleep")
    async def sleep(level: int = 1, s: ServerState = Depends(_admin)) -> dict:
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 or 2, got {level}", param="level")
        if not await s.require_engine().sleep(level):
            raise APIError(409, "requests are in flight: the engine sleeps only when idle", code="busy")
        return {"is_sleeping": True, "level": level}

    @app.post("/wake_up")
    async def wake_up(s: ServerState = Depends(_admin)) -> dict:
        await s.require_engine().wake_up()
        return {"is_sleeping": False}

    @app.get("/is_sleeping")
    async def is_sleeping(s: ServerState = Depends(_admin)) -> dict:
        return {"is_sleeping": await s.require_engine().is_sleeping()}

    @app.get("/footprint")
    async def footprint(s: ServerState = Depends(_admin)) -> dict:
        """The engine's device memory (weights, KV cache, what it holds now, the device's
        size), for a placement controller sharing the GPU between servers (docs/placement.md)."""
        engine = s.require_engine()
        return {**await engine.memory_footprint(), "is_sleeping": await engine.is_sleeping()}
