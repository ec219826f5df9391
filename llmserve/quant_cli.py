"""The `llmserve make-int8-checkpoint` command (its parser and handler; the work is in
llmserve/model/int8_checkpoint.py). Imports nothing heavy until it runs."""

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
    path = write_int8_checkpoint(_source(args.model), args.out, args.activations, ignore, smooth)
    print(f"wrote a W8A8 int8 checkpoint (compressed-tensors int-quantized, weight scales per channel, "
          f"{args.activations} activations{f', SmoothQuant alpha {smooth.alpha}' if smooth else ''}"
          f"{f', {len(ignore)} pattern(s) kept in 16 bits' if ignore else ''}) to {path}")  # fmt: skip


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
    p.set_defaults(func=_make_int8_checkpoint)
