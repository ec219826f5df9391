"""`llmserve serve`: the OpenAI-compatible server on uvicorn, with graceful shutdown.

SIGTERM (or Ctrl-C): stop accepting connections, let in-flight requests finish for up
to `--shutdown-timeout` seconds, cancel the rest (which aborts them in the engine),
then stop the engine core.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from llmserve.cli_args import add_engine_args, engine_args_from_cli
from llmserve.http_head_limit import DEFAULT_MAX_HEADER_BYTES
from llmserve.http_limits import DEFAULT_MAX_BODY_BYTES
from llmserve.http_protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    HttpLimits,
    uvicorn_options,
)
from llmserve.responses.storage import location_problem

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model with the OpenAI API (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on the API; given again, any of the keys (each key's stored "
        "responses are its own; default: $LLMSERVE_API_KEY; a key on the command line shows in the process list)",
    )
    p.add_argument("--responses-store", default=None, metavar="PATH|URL",
                   help="where stored responses live (/v1/responses with store, previous_response_id), kept "
                        "across restarts: an SQLite file, ':memory:' (in memory only), or a Postgres database "
                        "'postgresql://user@host/db' (needs psycopg; several servers may share it) (default: "
                        "$XDG_CACHE_HOME/llmserve/responses.sqlite, else ~/.cache/llmserve/responses.sqlite)")  # fmt: skip
    p.add_argument("--responses-max-count", type=int, default=10_000,
                   help="stored responses kept at most; the oldest go first (0: no limit; default: %(default)s)")  # fmt: skip
    p.add_argument("--responses-max-age-days", type=float, default=30.0,
                   help="stored responses older than this are deleted (0: kept until the count limit; "
                        "default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--admin-api-key",
        default=os.environ.get("LLMSERVE_ADMIN_API_KEY"),
        help="the key the admin routes (/sleep, /wake_up, /is_sleeping, /footprint, the runtime LoRA "
        "routes) need instead of --api-key (default: $LLMSERVE_ADMIN_API_KEY)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="413 for a request body over this size",
    )
    p.add_argument(
        "--max-request-header-bytes",
        type=int,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="431 for a request line and headers over this size",
    )
    p.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="408 (and the connection closed) for a request head not whole this long after the "
                        "connection opened or its last response ended (default: %(default)s)")  # fmt: skip
    p.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="408 (and the connection closed) when no part of a request body comes for this long "
                        "(default: %(default)s)")  # fmt: skip
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="connections held at once (kept to half the open-file limit); over it the one waiting "
                        "longest for its request is closed, or the new one refused (503) when all are busy (default: "
                        "%(default)s)")  # fmt: skip
    p.add_argument("--max-connections-per-client", type=int, default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                   help="connections held at once from one address, likewise (429); 0: no cap (behind a proxy, "
                        "every client has the proxy's address; default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served from the start, each named as a model (needs --enable-lora)",
    )
    p.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora; off: "
                        "404, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING); they need the admin key "
                        "(--admin-api-key, else --api-key)")  # fmt: skip
    p.add_argument("--allow-unauthenticated-lora-updating", action="store_true",
                   help="let the runtime LoRA routes be called without a key when the server has none (needs "
                        "--lora-roots): anyone who reaches the port can load and unload adapters")  # fmt: skip
    p.add_argument("--lora-roots", nargs="+", default=[], metavar="DIR",
                   help="the folders /v1/load_lora_adapter may read adapters from (a path outside them, after "
                        "resolving symlinks and '..', is refused); default: any folder the server can read")  # fmt: skip
    p.add_argument("--max-queued-requests", type=int, default=None, help="503 above this many requests in flight")
    p.add_argument("--request-timeout-s", type=float, default=None,
                   help="the longest a completion or chat request may run, from its arrival to its last token "
                        "(a request may ask for less with `request_timeout_s`); past it the request is stopped "
                        "and answered 504, or its stream ends with that error (default: none, as vLLM)")  # fmt: skip
    p.add_argument("--shutdown-timeout", type=float, default=5.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", default="info")
    p.add_argument("--task", choices=["generate", "embed"], default="generate",
                   help="generate: completions and chat (an llmserve engine); embed: /v1/embeddings and "
                   "/v1/rerank from a sentence-transformers model (default all-MiniLM-L6-v2)")  # fmt: skip
    p.add_argument("--max-batch-inputs", type=int, default=64, help="--task embed: texts encoded in one batch")
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": the model\'s output is read for tool calls (needs --tool-call-parser)',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "openai"],
        default=None,  # openai/tool_parsers.PARSERS
        help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>, Hermes and Qwen 2.5/3), "
        "llama3_json (Llama 3.1-3.3), mistral ([TOOL_CALLS]), pythonic ([f(x=1)], Llama 3.2/4), qwen3_coder "
        "(<function=...> XML), openai (gpt-oss, with --reasoning-parser gpt_oss)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3", "gpt_oss"],
        default=None,  # llmserve/reasoning.REASONING_PARSERS
        help="a reasoning model's thoughts (<think>...</think>, or gpt-oss's analysis channel) apart from its answer, as message.reasoning "
        "(and reasoning_content); tool calls and structured outputs apply to the answer (docs/reasoning.md)",
    )
    p.add_argument(
        "--request-timing-log",
        default=None,
        metavar="PATH",
        help="append one JSON line per finished request with its wall-clock times (HTTP arrival, "
        "core queue, first step, first token in the core and in the API, finish) to PATH",
    )
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run)


def _serve(build: Callable[[Callable[[str], None], Callable[[], None]], Any], args: argparse.Namespace,
           what: str) -> None:  # fmt: skip
    """Run the app `build(on_fatal, on_ready)` makes until SIGTERM; a model that cannot load
    stops the server with its reason (exit status 1)."""
    import uvicorn

    from llmserve.heap import freeze_startup_objects

    server = None
    failed: list[str] = []

    def on_fatal(reason: str) -> None:
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        limits = HttpLimits(args.max_request_header_bytes, args.header_timeout_s, args.body_timeout_s,
                            args.max_connections, args.max_connections_per_client)  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"llmserve serve: {exc}") from None
    # this process is the server's alone: keep its start-up heap out of the collector's scans
    app = build(on_fatal, lambda: freeze_startup_objects("API server"))
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout, **uvicorn_options(limits),
        )
    )  # fmt: skip
    logger.info("serving %s on http://%s:%d (model loading in the background)", what, args.host, args.port)
    server.run()
    if failed:
        raise SystemExit(f"llmserve serve: {failed[0]}")


def run_embed(args: argparse.Namespace) -> None:
    """`--task embed`: the model is a sentence-transformers folder; the engine flags do not apply."""
    from llmserve.config import DEFAULT_MODEL, _default_served_name, _resolve_device
    from llmserve.pooling import SentenceEncoder, default_embedding_model_dir
    from llmserve.serve.pooling_app import build_pooling_app
    from llmserve.serve.state import ServerConfig

    if args.max_batch_inputs < 1:
        raise SystemExit("llmserve serve: --max-batch-inputs must be >= 1")
    model = args.model_tag or (args.model if args.model != DEFAULT_MODEL else None)
    default_name = "all-MiniLM-L6-v2" if model is None else _default_served_name(model)
    model = model or default_embedding_model_dir()
    device = _resolve_device(args.device)  # as for the engine: a GPU asked for but absent fails here
    name = args.served_model_name or default_name
    config = ServerConfig(served_model_names=[name], model_path=model, api_key=_api_keys(args.api_key),
                          max_request_body_bytes=args.max_request_body_bytes)  # fmt: skip
    _serve(lambda on_fatal, on_ready: build_pooling_app(
        config, lambda: SentenceEncoder(model, device, args.max_batch_inputs), on_fatal, on_ready,
    ), args, f"embeddings of {model} as {name}")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    if args.task == "embed":
        return run_embed(args)

    from llmserve.engine.async_engine import AsyncEngine
    from llmserve.serve.app import build_app
    from llmserve.serve.state import ServerConfig

    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise SystemExit("llmserve serve: --enable-auto-tool-choice and --tool-call-parser go together")
    engine_config = engine_args_from_cli(args, "api_server").create_engine_config()  # bad flags fail here, fast
    mc = engine_config.model_config
    lora_modules = _lora_modules(args.lora_modules, engine_config)
    _check_runtime_lora(args, engine_config.lora is not None)
    if args.responses_max_count < 0 or args.responses_max_age_days < 0:
        raise SystemExit("llmserve serve: --responses-max-count and --responses-max-age-days must be >= 0")
    if (problem := location_problem(args.responses_store)) is not None:
        raise SystemExit(f"llmserve serve: --responses-store: {problem}")
    config = ServerConfig(
        served_model_names=[mc.served_model_name],
        model_path=mc.model,
        api_key=_api_keys(args.api_key),
        admin_api_key=args.admin_api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout_s,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        request_timing_log=args.request_timing_log,
        enable_sleep_mode=args.enable_sleep_mode,
        enable_lora=engine_config.lora is not None,
        lora_modules=lora_modules,
        enable_runtime_lora_updating=args.enable_runtime_lora_updating,
        lora_roots=[os.path.realpath(root) for root in args.lora_roots],
        responses_store=args.responses_store,
        responses_max_count=args.responses_max_count or None,
        responses_max_age_s=args.responses_max_age_days * 86400 or None,
    )

    def build(on_fatal, on_ready):
        try:
            return build_app(config, lambda: AsyncEngine(engine_config), on_fatal, on_ready)
        except OSError as exc:
            raise SystemExit(f"llmserve serve: --request-timing-log: {exc}") from None

    _serve(build, args, mc.served_model_name)


def _api_keys(given: list[str] | None) -> str | list[str] | None:
    """The keys of `--api-key` (each time it is given), else $LLMSERVE_API_KEY's."""
    if not given:
        return os.environ.get("LLMSERVE_API_KEY")
    if any(not key for key in given):
        raise SystemExit("llmserve serve: --api-key: a key cannot be empty")
    return given[0] if len(given) == 1 else given


def _check_runtime_lora(args: argparse.Namespace, enable_lora: bool) -> None:
    """Runtime adapter loading is the operator's explicit choice, behind a key unless they say otherwise."""
    runtime = args.enable_runtime_lora_updating
    if runtime and not enable_lora:
        raise SystemExit("llmserve serve: --enable-runtime-lora-updating needs --enable-lora")
    if args.lora_roots and not runtime:
        raise SystemExit("llmserve serve: --lora-roots limits /v1/load_lora_adapter, which only "
                         "--enable-runtime-lora-updating serves")  # fmt: skip
    if args.allow_unauthenticated_lora_updating and not (runtime and args.lora_roots):
        raise SystemExit("llmserve serve: --allow-unauthenticated-lora-updating needs --enable-runtime-lora-updating "
                         "and --lora-roots (the folders anyone may make the server read)")  # fmt: skip
    if (
        runtime
        and args.admin_api_key is None
        and _api_keys(args.api_key) is None
        and not args.allow_unauthenticated_lora_updating
    ):
        raise SystemExit("llmserve serve: --enable-runtime-lora-updating needs a key for its routes: --admin-api-key "
                         "(or $LLMSERVE_ADMIN_API_KEY), or --api-key; or --allow-unauthenticated-lora-updating")  # fmt: skip
    if runtime and not args.lora_roots:
        logger.warning("runtime LoRA loading may read any folder this process can read: --lora-roots limits it")


def _lora_modules(specs: list[str], engine_config) -> dict[str, str]:
    """`--lora-modules name=path ...`, each adapter read and checked against the model now, so
    a bad one stops the server at start with the reason (its path resolved once: the one read)."""
    if not specs:
        return {}
    if engine_config.lora is None:
        raise SystemExit("llmserve serve: --lora-modules needs --enable-lora")
    from llmserve.lora import LoRAAdapterError, read_peft_adapter
    from llmserve.lora_request import parse_lora_module

    modules: dict[str, str] = {}
    for spec in specs:
        try:
            name, path = parse_lora_module(spec)
        except ValueError as exc:
            raise SystemExit(f"llmserve serve: --lora-modules: {exc}") from None
        if name == engine_config.model_config.served_model_name or name in modules:
            raise SystemExit(f"llmserve serve: --lora-modules names {name!r} twice (or as the base model)")
        path = os.path.realpath(path)
        try:
            read_peft_adapter(path, name, engine_config.model_config.arch, engine_config.lora.max_lora_rank)
        except LoRAAdapterError as exc:
            raise SystemExit(f"llmserve serve: LoRA adapter {name!r}: {exc.detail}") from None
        modules[name] = path
    return modules
