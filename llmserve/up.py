"""`llmserve up`: the whole platform on one machine in one command.

Triton Inference Server hosting chat (an llmserve engine on the default model, SmolLM2-135M-Instruct), embed and rerank
(all-MiniLM-L6-v2), and the gateway in front of it speaking the OpenAI API; Prometheus
metrics on the gateway's /metrics and Triton's metrics port. Ctrl-C or SIGTERM stops both.
A watchdog reloads a model whose backend died and restarts a dead Triton (triton/watchdog.py);
the gateway holds requests that no replica could start meanwhile and retries them.

platform.yaml (all optional):
    models:   # the Triton models, as for `llmserve triton build-repo --config`
      chat: {kind: chat, max_model_len: 1024}   # also reasoning_parser, tool_call_parser (as serve's)
      embed: {kind: embed}
    gateway:  # a gateway config (docs/gateway.md); `models` defaults to one alias per Triton model
      keys: [...]
      admission: {max_concurrency: 64}
      responses: {store: /path/responses.sqlite}   # /v1/responses, served by the gateway over chat
    gpu_memory_budget: 0.6   # several chat models on one GPU (docs/placement.md): bytes, a fraction, "40GiB"
    placement: {policy: demand, sleep_level: 1, wake_timeout_s: 60, models: [chat-a, chat-b]}

With a `gpu_memory_budget`, the chat models (or those `placement.models` names) share the
GPU: they load one at a time, each one that does not fit beside those loaded before it goes
to sleep at once, and the gateway wakes them on demand (llmserve/gateway/placement.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

logger = logging.getLogger("llmserve.up")


def gateway_config(spec: dict, model_names: list[str], replica: str, placed: list[str] | None = None) -> dict:
    """The gateway's config: the platform.yaml's `gateway:` section, aliases for Triton's models
    (on `replica`, the Triton server's URL) by default, and the placement of the models sharing the GPU."""
    config = dict(spec.get("gateway") or {})
    if "models" not in config:
        config["models"] = {name: {"kind": "triton", "replicas": [replica]} for name in model_names}
    placement = placement_config(spec, placed or [])
    if placement is not None and "placement" not in config:
        config["placement"] = placement
    return config


def placed_models(spec: dict, models: list) -> list[str]:
    """The chat models that share the GPU under the platform.yaml's `gpu_memory_budget`."""
    if spec.get("gpu_memory_budget") is None:
        if spec.get("placement"):
            raise ValueError("placement: needs a gpu_memory_budget")
        return []
    section = dict(spec.get("placement") or {})
    chat = [m.name for m in models if m.kind == "chat"]
    names = section.get("models", chat)
    unknown = [n for n in names if n not in chat]
    if unknown or not names:
        raise ValueError(f"placement: models must name chat models of this platform ({chat}), got {names}")
    return list(names)


def placement_config(spec: dict, placed: list[str]) -> dict | None:
    """The gateway's `placement:` section from the platform.yaml's budget and placement settings."""
    if not placed:
        return None
    return {**dict(spec.get("placement") or {}), "gpu_memory_budget": spec["gpu_memory_budget"], "models": placed}


async def load_placed(http_url: str, replica_url: str, placed: list[str], budget_spec, sleep_level: int = 1,
                      held_asleep: Callable[[str], bool | None] | None = None) -> None:  # fmt: skip
    """Load the placed models one at a time; each that does not fit the budget beside those
    resident (and every loaded engine's own memory, held asleep too) goes to sleep at once,
    so the device holds at most the budget and one model. `held_asleep(name)` (after a Triton
    restart: the gateway's placement state) decides instead where it knows."""
    from llmserve.gateway.placement import TritonActuator
    from llmserve.gateway.triton_upstream import TritonClients
    from llmserve.placement.footprint import Footprint, parse_budget
    from llmserve.triton import control

    clients = TritonClients()
    actuator = TritonActuator(clients, {name: (replica_url, name) for name in placed})
    resident = overheads = 0
    try:
        for i, name in enumerate(placed, 1):
            start = time.monotonic()
            await asyncio.to_thread(control.load, http_url, name)
            row = await actuator.footprint(name)
            footprint = Footprint.from_row(row)
            size = footprint.total
            overheads += footprint.overhead_bytes
            budget = parse_budget(budget_spec, int(row.get("device_total_bytes") or 0) or None)
            known = held_asleep(name) if held_asleep is not None else None
            fits = resident + size + overheads <= budget if known is None else not known
            if fits:
                resident += size
            else:
                await actuator.sleep(name, sleep_level)
            logger.info("placed model %d/%d %s loaded in %.1f s (%.2f GiB): %s", i, len(placed), name,
                        time.monotonic() - start, size / 2**30,
                        "resident" if fits else f"asleep (over the {budget / 2**30:.2f} GiB budget)")  # fmt: skip
    finally:
        await clients.close()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("up", help="the whole platform: Triton (chat, embed, rerank) with the gateway in front")
    p.add_argument("--config", default=None, help="platform.yaml (default: the shipped models, an open gateway)")
    p.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port (the OpenAI API)")
    p.add_argument("--triton-http-port", type=int, default=8000)
    p.add_argument("--triton-grpc-port", type=int, default=8001)
    p.add_argument("--triton-metrics-port", type=int, default=8002)
    p.add_argument("--triton-transport", choices=("http", "grpc"), default="http",
                   help="how the gateway speaks to Triton: HTTP (KServe v2 and generate_stream; a streamed "
                        "token costs the gateway half of gRPC's) or gRPC")  # fmt: skip
    p.add_argument("--triton-address", default="127.0.0.1",
                   help="where Triton listens (default: this host only, so the gateway's keys and limits "
                        "cannot be gone around; 0.0.0.0 to let Prometheus elsewhere scrape it)")  # fmt: skip
    p.add_argument("--workdir", default=None,
                   help="model repository and Triton log (default: a temporary folder, removed when the platform "
                        "stops; kept, and named in the log, when it failed)")  # fmt: skip
    p.add_argument("--watchdog-interval-s", type=float, default=1.0,
                   help="how often the platform looks for a dead model backend (reloaded) or a dead Triton "
                        "(restarted); 0: never")  # fmt: skip
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from llmserve.up_workdir import platform_workdir

    with platform_workdir(args.workdir) as workdir:  # a temporary one is removed when the platform stops
        _run(args, workdir)


def _run(args: argparse.Namespace, workdir: str) -> None:
    import uvicorn

    from llmserve.gateway.app import build_app
    from llmserve.gateway.config import GatewayConfig
    from llmserve.http_protocol import uvicorn_options
    from llmserve.triton.build_repo import build_repo, load_platform_yaml
    from llmserve.triton.repo_config import platform_models
    from llmserve.triton.server import TritonServer
    from llmserve.triton.watchdog import Watchdog

    spec = load_platform_yaml(args.config) or {}
    models = platform_models(spec)
    placed = placed_models(spec, models)
    for m in models:
        if m.name in placed:
            m.parameters["enable_sleep_mode"] = "true"
    port = args.triton_http_port if args.triton_transport == "http" else args.triton_grpc_port
    triton_url = f"{args.triton_transport}://127.0.0.1:{port}"  # the gateway's replica of every model
    # checked before anything starts: a bad gateway section fails here
    config = GatewayConfig.model_validate(gateway_config(spec, [m.name for m in models], triton_url, placed))
    repo = build_repo(os.path.join(workdir, "model_repository"), models)
    log_path = os.path.join(workdir, "triton.log")
    triton = TritonServer(
        str(repo), http_port=args.triton_http_port, grpc_port=args.triton_grpc_port,
        metrics_port=args.triton_metrics_port, address=args.triton_address, exit_timeout_secs=10, log_path=log_path, stop_with_parent=True,
        load_models=[m.name for m in models if m.name not in placed],
    )  # fmt: skip
    # Ctrl-C or SIGTERM end the process through `finally` below, which stops Triton. While the
    # gateway serves, uvicorn takes the signals, drains, and raises them again once it has put
    # these handlers back.
    watchdog = None

    def _exit(signum: int, _frame) -> None:  # 1 once the watchdog gave up (its SIGTERM ends the platform here)
        raise SystemExit(1 if watchdog is not None and watchdog.gave_up else 0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit)

    def place(held_asleep: Callable[[str], bool | None] | None = None) -> None:
        if placed:
            http_url = f"127.0.0.1:{args.triton_http_port}"
            asyncio.run(load_placed(http_url, triton_url, placed, spec["gpu_memory_budget"],
                                    config.placement.sleep_level if config.placement else 1, held_asleep))  # fmt: skip

    logger.info("starting Triton with %s (log: %s)", ", ".join(m.name for m in models), log_path)
    app = build_app(config)
    triton.start()
    try:
        triton.wait_ready(timeout=600)
        place()
        if args.watchdog_interval_s > 0:
            # a dead backend is reloaded, a dead server restarted; too many restarts stop the platform (exit 1)
            # after a Triton restart the placed models sleep or wake as the gateway's placement holds them
            watchdog = Watchdog(triton, interval_s=args.watchdog_interval_s,
                                after_server_restart=lambda: place(lambda m: app.gateway.placed_asleep(triton_url, m)),
                                on_backend_dead=lambda model: app.gateway.triton_backend_died(triton_url, model),
                                on_model_restarted=lambda model: app.gateway.triton_backend_restarted(triton_url, model),
                                on_give_up=lambda: os.kill(os.getpid(), signal.SIGTERM)).start()  # fmt: skip
        logger.info(
            "llmserve is up: OpenAI API at http://%s:%d/v1 (models: %s); metrics at /metrics there and "
            "on :%d/metrics (Triton)", args.host, args.port, ", ".join(config.models), args.triton_metrics_port,
        )  # fmt: skip
        logging.getLogger("llmserve.gateway").setLevel(args.log_level.upper())
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    **uvicorn_options(config.http_limits()))  # fmt: skip
    finally:
        if watchdog is not None:
            watchdog.stop()
        logger.info("stopping Triton")
        triton.stop()
    if watchdog is not None and watchdog.gave_up:
        raise SystemExit(1)
