"""How much of FP8's perplexity cost on a small model is the E4M3 format itself (issue 19),
and how llmserve's FP8 scaling compares with vLLM's dynamic FP8 (per-tensor scales).

The bf16 model, then the same model with only its projection weights (q, k, v, o, gate, up,
down: what `--quantization fp8` quantizes) rounded to FP8 and back to bf16 ("fake quant"),
under several scalings: per output channel (what llmserve does), per group of 64 or 32
inputs of a channel (finer than any FP8 checkpoint format llmserve reads), per tensor, and
E5M2. Activations stay bf16 there, so the change is the weights' rounding alone; the "W+A"
rows round the projections' inputs too (per token, as llmserve does, or per tensor, as vLLM's
dynamic `quantization="fp8"` does, with per-tensor weight scales). Perplexity over the
same text and windows as `llmserve bench accuracy` (its `read_text`), on the CPU.

    python scripts/studies/fp8_weight_format.py --model SmolLM2-135M-Instruct --text docs/architecture.md
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from llmserve.bench.accuracy import load_for_reading, read_text
from llmserve.config import EngineArgs

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def fake_quant(w: torch.Tensor, dtype: torch.dtype, group: int | None) -> torch.Tensor:
    """w rounded to `dtype` with an absmax scale per row (group None), per `group` inputs of a
    row, or per tensor (group 0), and back to w's dtype."""
    top = torch.finfo(dtype).max
    x = w.float()
    if group == 0:
        amax = x.abs().amax().clamp(min=1e-12)
        return ((x / amax * top).to(dtype).float() * amax / top).to(w.dtype)
    rows, cols = x.shape
    g = cols if group is None else group
    xg = x.reshape(rows, cols // g, g)
    amax = xg.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    q = (xg / amax * top).to(dtype).float() * amax / top
    return q.reshape(rows, cols).to(w.dtype)


def study_parser() -> argparse.ArgumentParser:
    """The options of the FP8 studies that read several texts (fp8_sensitivity, fp8_norm_folding)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--text", nargs="+", default=["docs/architecture.md"])
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--output-json", default=None)
    return ap


def load_study(opts: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, list[int]]]:
    """The bf16 model on the CPU, read as `llmserve bench accuracy` reads it, and each text's
    token ids (up to --max-positions + 1)."""
    model, tokenizer, _ = load_for_reading(EngineArgs(model=opts.model, dtype="bfloat16", device="cpu"))
    return model, {t: tokenizer.encode(Path(t).read_text(encoding="utf-8"), add_special_tokens=False,
                                       verbose=False)[: opts.max_positions + 1] for t in opts.text}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--text", default="docs/architecture.md")
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--output-json", default=None)
    opts = ap.parse_args()
    model, tokenizer, cfg = load_for_reading(EngineArgs(model=opts.model, dtype="bfloat16", device="cpu"))
    ids = tokenizer.encode(Path(opts.text).read_text(encoding="utf-8"), add_special_tokens=False,
                           verbose=False)[: opts.max_positions + 1]  # fmt: skip
    weights = {n: p for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] in PROJECTIONS}
    original = {n: p.detach().clone() for n, p in weights.items()}
    device, kv = torch.device("cpu"), torch.bfloat16

    def ppl() -> tuple[float, list[int]]:
        r = read_text(model, ids, opts.window, device, kv)
        return math.exp(sum(r.nll) / len(r.nll)), r.top1

    base, base_top1 = ppl()
    print(f"bf16: perplexity {base:.4f} over {len(base_top1)} positions", flush=True)
    # name: (weight dtype, weight scale groups, activation scaling: None (bf16), "token" or "tensor")
    variants = {"e4m3, per output channel (llmserve)": (torch.float8_e4m3fn, None, None),
                "e4m3, per group of 64 inputs": (torch.float8_e4m3fn, 64, None),
                "e4m3, per group of 32 inputs": (torch.float8_e4m3fn, 32, None),
                "e4m3, per tensor": (torch.float8_e4m3fn, 0, None),
                "e5m2, per output channel": (torch.float8_e5m2, None, None),
                "W+A: per channel, activations per token (llmserve's fp8)": (torch.float8_e4m3fn, None, "token"),
                "W+A: per channel, activations per tensor": (torch.float8_e4m3fn, None, "tensor"),
                "W+A: per tensor, activations per tensor (vLLM's dynamic fp8)": (torch.float8_e4m3fn, 0, "tensor")}  # fmt: skip
    modules = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]
    rows = {"bf16": {"perplexity": round(base, 4)}}
    for name, (dtype, group, acts) in variants.items():
        started = time.perf_counter()
        hooks = [m.register_forward_pre_hook(lambda _m, args, g=(0 if acts == "tensor" else None):
                                             (fake_quant(args[0], torch.float8_e4m3fn, g),))
                 for m in modules] if acts else []  # fmt: skip
        errors = []
        with torch.no_grad():
            for n, p in weights.items():
                q = fake_quant(original[n], dtype, group)
                errors.append(((q.float() - original[n].float()).norm() / original[n].float().norm()).item())
                p.copy_(q)
        value, top1 = ppl()
        for hook in hooks:
            hook.remove()
        agree = sum(a == b for a, b in zip(top1, base_top1)) / len(top1)
        rows[name] = {"perplexity": round(value, 4), "change_pct": round(100 * (value / base - 1), 3),
                      "top1_agreement": round(agree, 4), "weight_rel_error_mean": round(sum(errors) / len(errors), 5)}  # fmt: skip
        print(f"{name}: perplexity {value:.4f} ({rows[name]['change_pct']:+.2f} %), top-1 agreement {agree:.3f}, "
              f"weights' relative error {rows[name]['weight_rel_error_mean']:.4f} ({time.perf_counter() - started:.0f} s)",
              flush=True)  # fmt: skip
    with torch.no_grad():
        for n, p in weights.items():
            p.copy_(original[n])
    if opts.output_json:
        Path(opts.output_json).write_text(json.dumps({"model": opts.model, "text": opts.text, "positions": len(base_top1),
                                                      "window": opts.window, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
