"""The `llmserve make-int8-checkpoint` and `make-w4a16-checkpoint` commands (parsers and handlers;
the work is in llmserve/model/int8_checkpoint.py and w4a16_checkpoint.py). Imports nothing heavy
until they run."""

from __future__ import annotations

import argparse


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in (value or "").split(",") if p.strip())


def _source(model: str):
    from pathlib import Path

    from llmserve.config import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(model) if model == DEFAULT_MODEL else Path(model)


def _make_int8_checkpoint(args: argparse.Namespace) -> None:
    from llmserve.model.int8_checkpoint import SmoothQuant, write_int8_checkpoint

    if args.calibration_text and args.smoothquant is None:
        raise ValueError("make-int8-checkpoint: --calibration-text is read by --smoothquant")
    smooth = None
    if args.smoothquant is not None:
        if not 0.0 <= args.smoothquant <= 1.0:
            raise ValueError(f"--smoothquant: the migration strength alpha is in [0, 1]; got {args.smoothquant}")
        smooth = SmoothQuant(args.smoothquant, tuple(args.calibration_text or ()), args.calibration_tokens)
    ignore = _split(args.ignore)
    path = write_int8_checkpoint(_source(args.model), args.out, args.activations, ignore, smooth, args.int8_embedding)
    print(f"wrote a W8A8 int8 checkpoint (compressed-tensors int-quantized, weight scales per channel, "
          f"{args.activations} activations{f', SmoothQuant alpha {smooth.alpha}' if smooth else ''}"
          f"{f', {len(ignore)} pattern(s) kept in 16 bits' if ignore else ''}"
          f"{', the embedding in int8' if args.int8_embedding else ''}) to {path}")  # fmt: skip


def _make_w4a16_checkpoint(args: argparse.Namespace) -> None:
    from llmserve.model.fp8_checkpoint import GptqCalibration
    from llmserve.model.w4a16_awq import AwqCalibration
    from llmserve.model.w4a16_checkpoint import write_w4a16_checkpoint

    if args.gptq and not args.calibration_text:
        raise ValueError("make-w4a16-checkpoint --gptq needs --calibration-text (UTF-8 files; none of the text you "
                         "will measure on)")  # fmt: skip
    if args.calibration_text and not args.gptq and args.method != "awq":
        raise ValueError("make-w4a16-checkpoint: --calibration-text is read by --gptq and by --method awq")
    texts = tuple(args.calibration_text or ())
    gptq = GptqCalibration(texts, args.calibration_tokens) if args.gptq else None
    # --method awq with calibration text: AutoAWQ's activation-aware scales (without: round to nearest)
    awq = AwqCalibration(texts, args.calibration_tokens) if args.method == "awq" and texts and not args.gptq else None
    sym = args.method == "gptq" and not args.zero_points
    path = write_w4a16_checkpoint(_source(args.model), args.out, args.method, args.group_size, sym, args.desc_act, gptq,
                                  awq)  # fmt: skip
    rounding = "GPTQ" if gptq else "activation-aware scales, round to nearest" if awq else "round to nearest"
    print(
        f"wrote a 4-bit {args.method.upper()} checkpoint (group size {args.group_size}, "
        f"{'symmetric' if sym else 'zero points'}{', act-order' if args.desc_act else ''}, {rounding}) to {path}"
    )


def add_parsers(sub) -> None:
    """Add the commands to the `llmserve` subparsers."""
    p = sub.add_parser("make-int8-checkpoint", help="write a Hugging Face folder's projections as a W8A8 int8 "
                       "checkpoint (compressed-tensors)")  # fmt: skip
    p.add_argument("model", help="a Hugging Face folder (safetensors), a GGUF file, or the default model's name")
    p.add_argument("out")
    p.add_argument("--activations", default="dynamic", choices=["dynamic", "static"],
                   help="dynamic: per token at run time; static: a scale per tensor calibrated on a few prompts")  # fmt: skip
    p.add_argument("--ignore", default=None, help="projections left in 16 bits, comma-separated, as "
                   "--quantization-ignore names them; written to the config's ignore list")  # fmt: skip
    p.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA", help="migrate activation outliers "
                   "into the weights first (SmoothQuant, strength ALPHA, 0.5 typical; Llama-family folders)")  # fmt: skip
    p.add_argument("--calibration-text", nargs="+", default=None, help="UTF-8 files SmoothQuant measures activations "
                   "on (default: a few fixed prompts)")  # fmt: skip
    p.add_argument("--calibration-tokens", type=int, default=4096, help="calibration tokens in all")
    p.add_argument("--int8-embedding", action="store_true", help="the embedding's rows in int8 too, a float32 "
                   "scale each (llmserve reads it; the LM head stays 16-bit unless tied to the embedding)")  # fmt: skip
    p.set_defaults(func=_make_int8_checkpoint)

    w = sub.add_parser("make-w4a16-checkpoint", help="write a Hugging Face folder's projections as a 4-bit GPTQ or "
                       "AWQ checkpoint (round to nearest per group, GPTQ, or AWQ's activation-aware scales)")  # fmt: skip
    w.add_argument("model", help="a Hugging Face folder (safetensors), a GGUF file, or the default model's name")
    w.add_argument("out")
    w.add_argument("--method", default="gptq", choices=["gptq", "awq"], help="the file format (AWQ: zero points)")
    w.add_argument("--group-size", type=int, default=128, help="inputs sharing a scale (must divide the model's widths; "
                   "-1: one group a row)")  # fmt: skip
    w.add_argument("--zero-points", action="store_true", help="GPTQ: a zero point per group (sym false)")
    w.add_argument("--desc-act", action="store_true", help="GPTQ act-order: groups over the inputs sorted by "
                   "importance (here the weights' column norms, shared by q/k/v and gate/up)")  # fmt: skip
    w.add_argument("--gptq", action="store_true", help="round by GPTQ (error-compensating, layer by layer) on "
                   "--calibration-text instead of to nearest; with --desc-act the inputs' Hessian orders them")  # fmt: skip
    w.add_argument("--calibration-text", nargs="+", default=None, help="UTF-8 files GPTQ calibrates on; with "
                   "--method awq (and no --gptq), AWQ's activation-aware scales are searched on them (as AutoAWQ "
                   "does; without text, AWQ files are rounded to nearest)")  # fmt: skip
    w.add_argument("--calibration-tokens", type=int, default=8192, help="calibration tokens in all")
    w.set_defaults(func=_make_w4a16_checkpoint)
