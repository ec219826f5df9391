"""`llmserve serve`: the OpenAI-compatible server on uvicorn, with graceful shutdown.

SIGTERM (or Ctrl-C): stop accepting connections, let in-flight requests finish for up
to `--shutdown-timeout` seconds, cancel the rest (which aborts them in the engine),
then stop the engine core.
"""

from __future__ import annotations

import argparse
import logging

from llmserve.cli_args import add_engine_args, engine_args_from_cli

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model with the OpenAI API (default: the shipped model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API")
    p.add_argument("--max-queued-requests", type=int, default=None, help="503 above this many requests in flight")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", default="info")
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import uvicorn  # imported here so other subcommands do not need the server's packages

    from llmserve.engine.async_engine import AsyncEngine
    from llmserve.heap import freeze_startup_objects
    from llmserve.serve.app import build_app
    from llmserve.serve.state import ServerConfig

    engine_config = engine_args_from_cli(args).create_engine_config()  # bad flags fail here, fast
    mc = engine_config.model_config
    config = ServerConfig(
        served_model_names=[mc.served_model_name],
        model_path=mc.model,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
    )
    server = None
    failed: list[str] = []

    def on_fatal(reason: str) -> None:
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    # this process is the server's alone: keep its start-up heap out of the collector's scans
    app = build_app(config, lambda: AsyncEngine(engine_config), on_fatal, lambda: freeze_startup_objects("API server"))
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5,
        )
    )  # fmt: skip
    logger.info("serving %s on http://%s:%d (model loading in the background)", mc.served_model_name, args.host, args.port)
    server.run()
    if failed:
        raise SystemExit(f"llmserve serve: {failed[0]}")
