"""`llmserve up`: the whole platform on one machine in one command.

Triton Inference Server hosting chat (an llmserve engine on the default model, SmolLM2-135M-Instruct), embed and rerank
(all-MiniLM-L6-v2), and the gateway in front of it speaking the OpenAI API; Prometheus
metrics on the gateway's /metrics and Triton's metrics port. Ctrl-C or SIGTERM stops both.

platform.yaml (all optional):
    models:   # the Triton models, as for `llmserve triton build-repo --config`
      chat: {kind: chat, max_model_len: 1024}
      embed: {kind: embed}
    gateway:  # a gateway config (docs/gateway.md); `models` defaults to one alias per Triton model
      keys: [...]
      admission: {max_concurrency: 64}
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import tempfile

logger = logging.getLogger("llmserve.up")


def gateway_config(spec: dict, model_names: list[str], grpc_port: int) -> dict:
    """The gateway's config: the platform.yaml's `gateway:` section, aliases for Triton's models by default."""
    config = dict(spec.get("gateway") or {})
    if "models" not in config:
        replica = f"grpc://127.0.0.1:{grpc_port}"
        config["models"] = {name: {"kind": "triton", "replicas": [replica]} for name in model_names}
    return config


def _exit(signum: int, _frame) -> None:
    raise SystemExit(0)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("up", help="the whole platform: Triton (chat, embed, rerank) with the gateway in front")
    p.add_argument("--config", default=None, help="platform.yaml (default: the shipped models, an open gateway)")
    p.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port (the OpenAI API)")
    p.add_argument("--triton-http-port", type=int, default=8000)
    p.add_argument("--triton-grpc-port", type=int, default=8001)
    p.add_argument("--triton-metrics-port", type=int, default=8002)
    p.add_argument("--triton-address", default="127.0.0.1",
                   help="where Triton listens (default: this host only, so the gateway's keys and limits "
                        "cannot be gone around; 0.0.0.0 to let Prometheus elsewhere scrape it)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="model repository and Triton log (default: a temporary folder)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from llmserve.gateway.app import build_app
    from llmserve.gateway.config import GatewayConfig
    from llmserve.triton.build_repo import build_repo, load_platform_yaml
    from llmserve.triton.repo_config import platform_models
    from llmserve.triton.server import TritonServer

    spec = load_platform_yaml(args.config) or {}
    models = platform_models(spec)
    # checked before anything starts: a bad gateway section fails here
    config = GatewayConfig.model_validate(gateway_config(spec, [m.name for m in models], args.triton_grpc_port))
    workdir = args.workdir or tempfile.mkdtemp(prefix="llmserve-up-")
    repo = build_repo(os.path.join(workdir, "model_repository"), models)
    log_path = os.path.join(workdir, "triton.log")
    triton = TritonServer(
        str(repo), http_port=args.triton_http_port, grpc_port=args.triton_grpc_port,
        metrics_port=args.triton_metrics_port, address=args.triton_address, exit_timeout_secs=10, log_path=log_path, stop_with_parent=True,
    )  # fmt: skip
    # Ctrl-C or SIGTERM end the process through `finally` below, which stops Triton. While the
    # gateway serves, uvicorn takes the signals, drains, and raises them again once it has put
    # these handlers back.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit)
    logger.info("starting Triton with %s (log: %s)", ", ".join(m.name for m in models), log_path)
    triton.start()
    try:
        triton.wait_ready(timeout=600)
        logger.info(
            "llmserve is up: OpenAI API at http://%s:%d/v1 (models: %s); metrics at /metrics there and "
            "on :%d/metrics (Triton)", args.host, args.port, ", ".join(config.models), args.triton_metrics_port,
        )  # fmt: skip
        logging.getLogger("llmserve.gateway").setLevel(args.log_level.upper())
        uvicorn.run(build_app(config), host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        logger.info("stopping Triton")
        triton.stop()
