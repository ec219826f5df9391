"""The `llmserve` command: serve, generate, bench, and model tools."""

from __future__ import annotations

import argparse
import logging
import sys

# commands that must start fast and without torch (the gateway is a plain HTTP proxy)
_LIGHT_COMMANDS = {"gateway"}


def _generate(args: argparse.Namespace) -> None:
    from llmserve import LLM, SamplingParams
    from llmserve.cli_args import engine_args_from_cli

    llm = LLM(**vars(engine_args_from_cli(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed_sampling)
    prompts = args.prompt or ["The capital of France is", "A list in Python is", "To open a file in Python,"]
    for out in llm.generate(prompts, params):
        print(f"\n>>> {out.prompt}\n{out.outputs[0].text}")


def _make_random_model(args: argparse.Namespace) -> None:
    from llmserve.model.random_model import make_random_model

    overrides = {
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "max_position_embeddings": args.max_position_embeddings,
    }
    if args.rope_scaling_llama3:
        overrides["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        }  # fmt: skip
        overrides["rope_theta"] = 500000.0
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):  # the MoE families'
        if getattr(args, key) is not None:  # Mixtral's experts are intermediate_size wide
            overrides["intermediate_size" if key == "moe_intermediate_size" and args.family == "mixtral" else key] = (
                getattr(args, key))  # fmt: skip
    path = make_random_model(
        args.out, args.family, seed=args.seed, vocab_size=args.vocab_size,
        config_only=args.config_only, **overrides,
    )  # fmt: skip
    print(f"wrote a random {args.family} model to {path}")


def _make_fp8_checkpoint(args: argparse.Namespace) -> None:
    from pathlib import Path

    from llmserve.config import DEFAULT_MODEL, resolve_model_path
    from llmserve.model.fp8_checkpoint import GptqCalibration, write_fp8_checkpoint

    if args.gptq and not args.calibration_text:
        raise ValueError("make-fp8-checkpoint --gptq needs --calibration-text (UTF-8 files; none of the text you "
                         "will measure on)")  # fmt: skip
    if args.calibration_text and not args.gptq:
        raise ValueError("make-fp8-checkpoint: --calibration-text is read by --gptq")
    gptq = GptqCalibration(tuple(args.calibration_text), args.calibration_tokens) if args.gptq else None
    ignore = tuple(p.strip() for p in (args.ignore or "").split(",") if p.strip())
    source = resolve_model_path(args.model) if args.model == DEFAULT_MODEL else Path(args.model)
    path = write_fp8_checkpoint(source, args.out, args.format, args.weights, args.activations,
                                kv_scales=args.kv_scales, ignore=ignore, gptq=gptq)  # fmt: skip
    print(f"wrote an FP8 checkpoint ({args.format}, weight scales per {args.weights}, "
          f"{'GPTQ' if gptq else 'round-to-nearest'} weights, {args.activations} activations"
          f"{', KV cache scales' if args.kv_scales else ''}{f', {len(ignore)} pattern(s) kept in 16 bits' if ignore else ''}) "
          f"to {path}")  # fmt: skip


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command; with `only` (a light command), just that one, importing nothing heavy."""
    from llmserve.gateway import cli as gateway_cli

    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    if only == "gateway":
        gateway_cli.add_parser(sub)
        return parser

    from llmserve import up
    from llmserve.bench import add_bench_parsers
    from llmserve.cli_args import add_engine_args
    from llmserve.serve import server
    from llmserve.triton import cli as triton_cli

    server.add_parser(sub)
    triton_cli.add_parser(sub)
    gateway_cli.add_parser(sub)
    up.add_parser(sub)

    gen = sub.add_parser("generate", help="offline generation demo on a model (default: SmolLM2-135M-Instruct)")
    gen.add_argument("prompt", nargs="*", help="prompts (default: a few examples)")
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--seed-sampling", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    tune = sub.add_parser(
        "tune", help="measure the kernels' settings on this GPU and write them for every engine on it"
    )
    tune.add_argument("--model", help="a Hugging Face folder (or GGUF file) whose shapes to tune for; the flags "
                      "below override its values")  # fmt: skip
    tune.add_argument("--hidden-size", type=int, help="the projections' shapes: a model's (default: 8B's, 4096)")
    tune.add_argument("--intermediate-size", type=int, help="default 14336")
    tune.add_argument("--num-heads", type=int, help="default 32")
    tune.add_argument("--num-kv-heads", type=int, help="default 8")
    tune.add_argument("--head-dim", type=int, help="default 128")
    tune.add_argument("--num-experts", type=int, help="a MoE's experts (none: no fused MoE tables)")
    tune.add_argument("--moe-intermediate-size", type=int, help="each expert's width")
    tune.add_argument("--num-experts-per-tok", type=int, help="experts a token")
    tune.add_argument("--only", default="all", choices=["all", "dense", "moe"],
                      help="dense: projections and attention; moe: the fused MoE's tiles alone")  # fmt: skip
    tune.add_argument("--moe-tokens", type=lambda v: tuple(int(t) for t in v.split(",")), default=None,
                      help="the token counts (batch buckets) the fused MoE's tiles are tuned at, comma-separated "
                      "(default: 16 to 16,384; fewer tune faster, the others keep the defaults)")  # fmt: skip
    tune.add_argument("--device", default="cuda")
    tune.set_defaults(func=_tune)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_parsers(bench_sub)

    rm = sub.add_parser("make-random-model", help="write a small random-weight HF model folder")
    rm.add_argument("out")
    rm.add_argument("--family", default="llama",
                    choices=["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])  # fmt: skip
    rm.add_argument("--vocab-size", type=int, default=512)
    rm.add_argument("--hidden-size", type=int, default=64)
    rm.add_argument("--intermediate-size", type=int, default=128)
    rm.add_argument("--num-layers", type=int, default=2)
    rm.add_argument("--num-heads", type=int, default=4)
    rm.add_argument("--num-kv-heads", type=int, default=2)
    rm.add_argument("--max-position-embeddings", type=int, default=2048)
    rm.add_argument("--seed", type=int, default=0)
    rm.add_argument("--config-only", action="store_true", help="no weights: for --load-format dummy")
    rm.add_argument("--rope-scaling-llama3", action="store_true", help="Llama 3.1's rope scaling")
    rm.add_argument("--num-experts", type=int, help="MoE families: experts per layer (default 8)")
    rm.add_argument("--num-experts-per-tok", type=int, help="MoE families: experts a token (default 2)")
    rm.add_argument("--moe-intermediate-size", type=int, help="MoE families: each expert's width (default 32)")
    rm.set_defaults(func=_make_random_model)

    fp8 = sub.add_parser("make-fp8-checkpoint", help="write a Hugging Face folder's projections as an FP8 checkpoint")
    fp8.add_argument("model", help="a Hugging Face folder (safetensors), a GGUF file, or the default model's name")
    fp8.add_argument("out")
    fp8.add_argument("--format", default="compressed-tensors", choices=["fp8", "compressed-tensors"])
    fp8.add_argument(
        "--weights",
        default="channel",
        choices=["tensor", "channel"],
        help="a weight scale per tensor or per output channel (fp8: tensor)",
    )
    fp8.add_argument(
        "--activations",
        default="dynamic",
        choices=["dynamic", "static"],
        help="static: input scales calibrated on a few prompts",
    )
    fp8.add_argument(
        "--kv-scales",
        action="store_true",
        help="each layer's k_scale / v_scale for --kv-cache-dtype fp8 (kv_cache_scheme), calibrated on a few prompts",
    )
    fp8.add_argument("--ignore", default=None, help="projections left in 16 bits, comma-separated, as --quantization-ignore "
                     "names them (model.layers.N.PATH, PATH a linear layer of the model's family, or re:PATTERN); written to "
                     "the config's ignore list")  # fmt: skip
    fp8.add_argument("--gptq", action="store_true", help="round the weights by GPTQ (error-compensating, layer by layer) "
                     "on --calibration-text instead of to nearest; scales per channel")  # fmt: skip
    fp8.add_argument("--calibration-text", nargs="+", default=None, help="UTF-8 files GPTQ calibrates on (windows of 512 "
                     "tokens, one from each file in turn)")  # fmt: skip
    fp8.add_argument("--calibration-tokens", type=int, default=8192, help="calibration tokens in all")
    fp8.set_defaults(func=_make_fp8_checkpoint)
    from llmserve import quant_cli

    quant_cli.add_parsers(sub)  # make-int8-checkpoint, make-w4a16-checkpoint
    from llmserve.spec_train import cli as spec_train_cli

    spec_train_cli.add_parser(sub)  # train-eagle
    return parser


_TUNE_DEFAULTS = dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128)
_TUNE_SHAPE = (*_TUNE_DEFAULTS, "num_experts", "moe_intermediate_size", "num_experts_per_tok")


def tune_shapes(args: argparse.Namespace) -> dict[str, int | None]:
    """`llmserve tune`'s shapes: each flag given, else the --model's value (its config read as the
    engine reads it), else the 8B default (the experts: none)."""
    found: dict[str, int | None] = {}
    if args.model:
        from pathlib import Path

        from llmserve.config import read_arch

        arch = read_arch(Path(args.model))
        found = dict(hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
                     num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim)  # fmt: skip
        if getattr(arch, "num_experts", 0):  # a MoE (model/moe_block.py MoeArch)
            found.update(num_experts=arch.num_experts, moe_intermediate_size=arch.moe_intermediate_size,
                         num_experts_per_tok=arch.top_k)  # fmt: skip
    out = {}
    for name in _TUNE_SHAPE:
        given = getattr(args, name)
        out[name] = given if given is not None else found.get(name, _TUNE_DEFAULTS.get(name))
    return out


def _tune(args: argparse.Namespace) -> None:
    from llmserve.kernels.tune import run

    s = tune_shapes(args)
    path, values = run(s["hidden_size"], s["intermediate_size"], s["num_heads"], s["num_kv_heads"], s["head_dim"],
                       args.device, num_experts=s["num_experts"], moe_intermediate=s["moe_intermediate_size"],
                       top_k=s["num_experts_per_tok"], only=args.only, moe_tokens=args.moe_tokens)  # fmt: skip
    print(f"wrote {path}: {values or 'the defaults are best'}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in _LIGHT_COMMANDS else None).parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError, OSError) as exc:  # bad settings, a missing or unreadable file
        print(f"llmserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
