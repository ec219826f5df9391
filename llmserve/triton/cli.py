"""`llmserve triton ...`: build a model repository, serve it, drive its repository API."""

from __future__ import annotations

import argparse
import signal


def _build_repo(args: argparse.Namespace) -> None:
    from llmserve.triton.build_repo import build_repo, load_platform_yaml
    from llmserve.triton.repo_config import platform_models

    repo = build_repo(args.out, platform_models(load_platform_yaml(args.config)))
    print(f"wrote a Triton model repository to {repo}: {', '.join(sorted(p.name for p in repo.iterdir()))}")


def _serve(args: argparse.Namespace) -> None:
    from llmserve.triton.server import TritonServer

    server = TritonServer(
        args.model_repository, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, address=args.address, load_models=args.load_model or ["*"],
        exit_timeout_secs=args.exit_timeout_secs,
    ).start()  # fmt: skip
    # forward Ctrl-C / SIGTERM to the server and let it drain
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.proc.send_signal(signal.SIGTERM))
    raise SystemExit(server.wait())


def _control(args: argparse.Namespace) -> None:
    from llmserve.triton import control

    getattr(control, args.triton_command)(args.url, args.model)
    print(f"{args.triton_command}: {args.model} done")


def _bench_embed(args: argparse.Namespace) -> None:
    import json

    from llmserve.triton.bench import embed_throughput

    for model in args.model or ["embed"]:
        result = embed_throughput(args.url, model, args.concurrency, args.duration, args.texts_per_request)
        print(json.dumps(result.as_dict()))


def _bench_chat(args: argparse.Namespace) -> None:
    import json

    from llmserve.triton.bench import chat_throughput

    result = chat_throughput(args.url, args.model, args.num_prompts, args.max_tokens, args.concurrency)
    print(json.dumps(result.as_dict()))


def add_parser(sub) -> None:
    triton = sub.add_parser("triton", help="Triton Inference Server: model repository and server")
    tsub = triton.add_subparsers(dest="triton_command", required=True)

    build = tsub.add_parser("build-repo", help="write a Triton model repository (chat, embed, rerank)")
    build.add_argument("--config", default=None, help="platform.yaml (default: the shipped models)")
    build.add_argument("--out", default="model_repository")
    build.set_defaults(func=_build_repo)

    serve = tsub.add_parser("serve", help="run the Triton server shipped in nvidia-pytriton")
    serve.add_argument("--model-repository", required=True)
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--address", default="0.0.0.0", help="where the HTTP, gRPC and metrics endpoints listen")
    serve.add_argument("--load-model", action="append", help="model to load at start (default: all)")
    serve.add_argument("--exit-timeout-secs", type=int, default=30)
    serve.set_defaults(func=_serve)

    bench = tsub.add_parser("bench-embed", help="closed-loop embedding load: requests/s and latency")
    bench.add_argument("--model", action="append", default=None, help="model(s) to load (default: embed)")
    bench.add_argument("--url", default="127.0.0.1:8000", help="the server's HTTP address")
    bench.add_argument("--concurrency", type=int, default=32)
    bench.add_argument("--duration", type=float, default=10.0, help="seconds per model")
    bench.add_argument("--texts-per-request", type=int, default=1)
    bench.set_defaults(func=_bench_embed)

    chat = tsub.add_parser("bench-chat", help="streamed chat load over HTTP generate_stream: output tokens/s")
    chat.add_argument("--model", default="chat")
    chat.add_argument("--url", default="127.0.0.1:8000", help="the server's HTTP address")
    chat.add_argument("--num-prompts", type=int, default=64)
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--concurrency", type=int, default=16)
    chat.set_defaults(func=_bench_chat)

    for name, text in (("load", "load a model"), ("unload", "unload a model"),
                       ("reload", "reload a model (picks up new versions and config)"),
                       ("restart", "unload, then load a model (one whose backend died)")):  # fmt: skip
        cmd = tsub.add_parser(name, help=text)
        cmd.add_argument("model")
        cmd.add_argument("--url", default="127.0.0.1:8000", help="the server's HTTP address")
        cmd.set_defaults(func=_control)
