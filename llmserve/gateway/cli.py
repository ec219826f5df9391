"""`llmserve gateway --config gateway.yaml`."""

from __future__ import annotations

import argparse
import logging


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gateway", help="the OpenAI API in front of replicas: keys, limits, routing, fallback")
    p.add_argument("--config", required=True, help="gateway YAML (see docs/gateway.md)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from llmserve.gateway.app import build_app
    from llmserve.gateway.config import load_config
    from llmserve.http_protocol import uvicorn_options

    logging.getLogger("llmserve.gateway").setLevel(args.log_level.upper())
    config = load_config(args.config)
    app = build_app(config)  # a bad config fails here, before the port opens
    # the gateway writes its own access log (one JSON line a request): uvicorn's is off
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                **uvicorn_options(config.http_limits()))  # fmt: skip
