"""Whether error-compensating rounding (GPTQ) onto the E4M3 grid lowers FP8's perplexity cost on
a small model (issue 19): a study on the CPU, with fake quantization.

`--quantization fp8` rounds each projection weight (q/k/v, o, gate/up, down) to E4M3 to the
nearest value, with one scale per output channel (row absmax / 448), and each projection's input
per token. The weights' rounding is the largest single part of the cost. GPTQ
(`llmserve.model.fp8_gptq.gptq_fp8`) keeps the same grid and the same scales (fixed before it
runs) but rounds the weight column by column, moving each column's error onto the columns not
yet rounded through the inverse Hessian of the layer's inputs, collected from calibration text
that is none of the texts read. The FP8 weight it gives has the same form, so the engine would
run it unchanged.

Calibration: windows of --window tokens from --calibration-text (default README.md,
docs/models.md, docs/triton.md; none of --text), --calibration-tokens in all, the first text's
windows first (4,096 tokens: all from README.md). `--calibration-mode
sequential` (default) quantizes the model layer by layer, as the GPTQ paper does: the windows'
hidden states are kept between layers; layer i runs on them with hooks that sum its four
projections' input Hessians X^T X (within a layer, all four see the bf16 layer's own inputs),
GPTQ rounds its weights, and the layer runs again, quantized (bf16 activations), to give layer
i+1's inputs. `bf16` takes every layer's inputs from the bf16 model instead. A variant ending in
`+a8` rounds the projections' inputs per token in calibration too (the Hessians and the
quantized layers' inputs), so GPTQ aims at the W+A scheme.

Rows, each against the bf16 model (mean NLL over the texts, equal position counts: the change
of the geometric mean of their perplexities), and per text: round-to-nearest (RTN, today's
scheme) and GPTQ (`--variants`: columns in order, and "act order", columns by decreasing
H[i, i]), with weights only, with activations per token (the full `--quantization fp8` scheme,
as `fake_quant` rounds them), and with an FP8 KV cache on top (`--kv`: a real E4M3 cache read
by the reference attention, per-layer scales calibrated as the engine calibrates them at start,
`model.kv_scales.calibrate`, on the model as quantized). Per layer, the progress lines give
GPTQ's output error over the calibration inputs, tr((W-Q) H (W-Q)^T), relative to RTN's.

Speed: torch's bf16 GEMM on a CPU without bf16 instructions runs about 8x slower than float32.
Unless `--exact-bf16`, the bf16 projections and the LM head are computed as float32 products of
the same bf16 operands, rounded to bf16 (what a GEMM accumulating in float32 gives, as cuBLAS
does; it differs from torch's CPU bf16 GEMM in about 1 output in 10^4, by one bf16 unit). Per-token
FP8 rounding amplifies such differences: over the five texts, RTN measured +1.47 % (weights only)
and +2.16 % (W+A) this way against +1.29 % and +2.17 % with `--exact-bf16`; per text up to 0.8
points apart. Differences under about 0.3 points of the mean are noise.
A run of the command below (both variants, with the KV rows) takes about 12.5 minutes on 2 cores.

    python scripts/studies/fp8_gptq.py --text docs/architecture.md docs/reliability.md docs/placement.md \
        docs/lora.md docs/gateway.md --max-positions 2048 --output-json docs/cpu_fp8_gptq_2026-12-02.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_weight_format import PROJECTIONS, fake_quant, study_parser  # noqa: E402

from llmserve.bench.accuracy import load_for_reading, read_text  # noqa: E402
from llmserve.config import EngineArgs  # noqa: E402
from llmserve.model import kv_scales  # noqa: E402
from llmserve.model.fp8_gptq import dequantize  # noqa: E402
from llmserve.model.gptq_calibration import GptqOptions, calibration_windows, gptq_model, read_calibration_texts  # noqa: E402

E4M3 = torch.float8_e4m3fn
CPU = torch.device("cpu")
VARIANTS = ("columns", "act-order", "columns+a8", "act-order+a8")


def act_hooks(modules) -> list:
    """Per-token FP8 rounding of each module's input, as `--quantization fp8` does."""
    return [m.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0], E4M3, None),)) for m in modules]


@contextmanager
def float32_products(model):
    """bf16 linear layers and LM head computed as float32 products of the same bf16 operands,
    rounded to bf16 (what a bf16 GEMM that accumulates in float32 returns, up to the order of the
    sums): 8x faster on a CPU without bf16 instructions. `--exact-bf16` leaves them alone."""
    linear = F.linear
    embed = model.model.embed_tokens
    head = embed.weight.detach().float() if model.arch.tie_word_embeddings else model.lm_head.weight.detach().float()

    def linear32(x, w, b=None):
        if x.dtype != torch.bfloat16:
            return linear(x, w, b)
        return linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)

    def logits32(hidden, weight=None):
        return (hidden.float() @ head.t()).to(hidden.dtype)[..., : embed.vocab_size]

    F.linear, embed.logits = linear32, logits32
    try:
        yield
    finally:
        F.linear = linear
        del embed.logits


def main() -> None:
    ap = study_parser()
    ap.add_argument("--calibration-text", nargs="+", default=["README.md", "docs/models.md", "docs/triton.md"],
                    help="texts the Hessians come from (none of --text)")  # fmt: skip
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--calibration-mix", action="store_true", help="one window from each calibration text in turn")
    ap.add_argument("--keep", nargs="*", default=[],
                    help="regular expressions of projections (e.g. 'model\\.layers\\.29\\.mlp\\.down_proj') left in bf16, "
                         "weights and inputs, as --quantization-ignore leaves them")  # fmt: skip
    ap.add_argument("--calibration-mode", choices=("sequential", "bf16"), default="sequential",
                    help="layer i's inputs from the layers before it quantized (sequential) or from the bf16 model")  # fmt: skip
    ap.add_argument("--variants", default="columns,act-order",
                    help=f"GPTQ variants, comma-separated, of {', '.join(VARIANTS)}: column order or act order "
                         "(columns by decreasing H[i, i]); +a8: calibration inputs rounded to FP8 per token")  # fmt: skip
    ap.add_argument("--damp", type=float, default=0.01, help="fraction of H's mean diagonal added to its diagonal")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--kv", action=argparse.BooleanOptionalAction, default=True, help="also with an FP8 KV cache")
    ap.add_argument("--exact-bf16", action="store_true", help="bf16 GEMMs as torch runs them (slow on this CPU)")
    opts = ap.parse_args()
    overlap = {str(Path(t).resolve()) for t in opts.text} & {str(Path(t).resolve()) for t in opts.calibration_text}
    if overlap:
        ap.error(f"calibration text among the texts read: {sorted(overlap)}")
    variants = [v.strip() for v in opts.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        ap.error(f"unknown GPTQ variants {sorted(set(variants) - set(VARIANTS))}")
    with ExitStack() as stack:
        study(opts, variants, stack)


def study(opts: argparse.Namespace, variants: list[str], stack: ExitStack) -> None:
    started_all = time.perf_counter()
    model, tokenizer, _ = load_for_reading(EngineArgs(model=opts.model, dtype="bfloat16", device="cpu"))
    texts = {t: tokenizer.encode(Path(t).read_text(encoding="utf-8"), add_special_tokens=False,
                                 verbose=False)[: opts.max_positions + 1] for t in opts.text}  # fmt: skip
    windows = calibration_windows(read_calibration_texts(opts.calibration_text, tokenizer), opts.window,
                                  opts.calibration_tokens, opts.calibration_mix)  # fmt: skip
    print(f"texts: {', '.join(f'{t} ({len(ids) - 1})' for t, ids in texts.items())}; calibration: "
          f"{len(windows)} windows of {opts.window} from {', '.join(opts.calibration_text)}", flush=True)  # fmt: skip
    modules = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS}
    original = {n: m.weight.detach().clone() for n, m in modules.items()}
    kept = {n for n in modules if any(re.fullmatch(k, n) for k in opts.keep)}
    if opts.keep:
        print(f"kept in bf16: {', '.join(sorted(kept)) or 'nothing matched'}", flush=True)
    quantized_modules = [m for n, m in modules.items() if n not in kept]
    attention_layers = model.attention_layers()
    if not opts.exact_bf16:
        stack.enter_context(float32_products(model))

    def set_weights(weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, m in modules.items():
                m.weight.copy_(weights[n])

    def read(kv_dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[float, list[int]]]:
        out = {}
        for t, ids in texts.items():
            r = read_text(model, ids, opts.window, CPU, kv_dtype)
            out[t] = (sum(r.nll) / len(r.nll), r.top1)
        return out

    def output_error(n: str, q: torch.Tensor, h: torch.Tensor) -> float:
        """tr((W - Q) H (W - Q)^T): the squared output error over the calibration inputs."""
        d = original[n].double() - q.double()
        return float(((d @ h) * d).sum())

    def run_gptq(act_order: bool, a8: bool) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """Every projection but the kept ones rounded by GPTQ, layer by layer
        (`gptq_calibration.gptq_model`), with each layer's output error against RTN's."""
        log = []

        def report(r, done) -> None:
            errs = {}
            for n, (q, s) in done.items():
                rtn = fake_quant(original[n], E4M3, None)
                errs[n.rsplit(".", 1)[-1]] = round(output_error(n, dequantize(q, s, original[n].dtype), r.hessians[n])
                                                   / output_error(n, rtn, r.hessians[n]), 4)  # fmt: skip
            log.append({"layer": r.layer, "output_error_vs_rtn": errs})
            print(f"  layer {r.layer:2d}: output error GPTQ / RTN on the calibration inputs "
                  f"{' '.join(f'{k} {v:.3f}' for k, v in errs.items())} ({r.seconds:.1f} s)", flush=True)  # fmt: skip

        done = gptq_model(model, windows, kept, GptqOptions(opts.damp, opts.block, act_order),
                          input_transform=(lambda x: fake_quant(x, E4M3, None)) if a8 else None,
                          sequential=opts.calibration_mode == "sequential", on_layer=report)  # fmt: skip
        quantized = {n: original[n] for n in kept}
        quantized.update({n: dequantize(q, s, original[n].dtype) for n, (q, s) in done.items()})
        return quantized, log

    rows: dict[str, dict] = {}
    started = time.perf_counter()
    base = read()
    base_nll = sum(v[0] for v in base.values()) / len(base)
    print(f"bf16: perplexity {math.exp(base_nll):.4f} (geometric mean over the texts, {time.perf_counter() - started:.0f} s)",
          flush=True)  # fmt: skip
    rows["bf16"] = {"perplexity": round(math.exp(base_nll), 4),
                    "per_text_perplexity": {t: round(math.exp(v[0]), 4) for t, v in base.items()}}  # fmt: skip

    def measure(name: str, weights: dict[str, torch.Tensor] | None, acts: bool, kv: bool) -> None:
        started = time.perf_counter()
        set_weights(weights if weights is not None else original)
        hooks = act_hooks(quantized_modules) if acts else []
        scales = None
        try:
            if kv:  # the engine's calibration at start, on the model as it runs
                scales = kv_scales.calibrate(model, lambda ids: read_text(model, [*ids, 0], len(ids), CPU, E4M3),
                                             model.shard.vocab_size)  # fmt: skip
            got = read(E4M3 if kv else torch.bfloat16)
        finally:
            for h in hooks:
                h.remove()
            for layer in attention_layers:
                layer.kv_scales = (1.0, 1.0)
            set_weights(original)
        nll = sum(v[0] for v in got.values()) / len(got)
        change = 100 * (math.exp(nll - base_nll) - 1)
        per_text = {t: round(100 * (math.exp(got[t][0] - base[t][0]) - 1), 3) for t in texts}
        agree = sum(sum(a == b for a, b in zip(got[t][1], base[t][1])) for t in texts) / sum(
            len(base[t][1]) for t in texts
        )
        rows[name] = {"perplexity": round(math.exp(nll), 4), "change_pct": round(change, 3),
                      "top1_agreement": round(agree, 4), "per_text_change_pct": per_text}  # fmt: skip
        if scales is not None:
            rows[name]["kv_scales"] = scales.summary()
        print(f"{name}: perplexity {math.exp(nll):.4f} ({change:+.2f} %), top-1 agreement {agree:.4f}, per text "
              f"{' / '.join(f'{v:+.2f}' for v in per_text.values())} ({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip

    rtn = {n: w if n in kept else fake_quant(w, E4M3, None) for n, w in original.items()}
    if opts.kv:
        measure("bf16, KV fp8", None, acts=False, kv=True)
    measure("RTN, weights only", rtn, acts=False, kv=False)
    measure("RTN, W+A (--quantization fp8)", rtn, acts=True, kv=False)
    if opts.kv:
        measure("RTN, W+A, KV fp8", rtn, acts=True, kv=True)
    logs = {}
    for variant in variants:
        started = time.perf_counter()
        label = f"GPTQ ({variant})"
        print(f"{label}: calibrating ({opts.calibration_mode})", flush=True)
        gptq, logs[label] = run_gptq(variant.startswith("act-order"), variant.endswith("+a8"))
        print(f"{label}: quantized in {time.perf_counter() - started:.0f} s", flush=True)
        measure(f"{label}, weights only", gptq, acts=False, kv=False)
        measure(f"{label}, W+A", gptq, acts=True, kv=False)
        if opts.kv:
            measure(f"{label}, W+A, KV fp8", gptq, acts=True, kv=True)

    print("\n| configuration | perplexity | change | top-1 agreement | per text |\n| --- | ---: | ---: | ---: | --- |")
    for name, r in rows.items():
        if "change_pct" in r:
            print(f"| {name} | {r['perplexity']:.4f} | {r['change_pct']:+.2f} % | {100 * r['top1_agreement']:.2f} % | "
                  f"{' / '.join(f'{v:+.2f}' for v in r['per_text_change_pct'].values())} |")  # fmt: skip
        else:
            print(f"| {name} | {r['perplexity']:.4f} | | | |")
    elapsed = time.perf_counter() - started_all
    print(f"\ntotal {elapsed:.0f} s", flush=True)
    if opts.output_json:
        Path(opts.output_json).write_text(json.dumps({
            "model": opts.model, "texts": opts.text, "max_positions": opts.max_positions, "window": opts.window,
            "calibration": {"texts": opts.calibration_text, "tokens": len(windows) * opts.window,
                            "mode": opts.calibration_mode, "mix": opts.calibration_mix},
            "kept_in_bf16": sorted(kept),
            "gptq": {"damp": opts.damp, "block": opts.block, "scale": "row absmax / 448, fixed before GPTQ"},
            "float32_products": not opts.exact_bf16, "seconds": round(elapsed), "rows": rows, "layers": logs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
