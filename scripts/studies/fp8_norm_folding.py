"""Whether folding each RMSNorm's weight into the projection after it lowers FP8's perplexity
cost (issue 19), with nothing changed at run time: a study on the CPU, with fake quantization.

llmserve's FP8 (`--quantization fp8` from bf16 weights) quantizes each projection's input per
token and its weight per output channel. The input of qkv_proj and gate_up_proj is an RMSNorm's
output, `gamma * x_hat`: channels with a large gamma set each token's FP8 scale, and the others
lose precision. Folding gamma into the weight's input columns (W' = W diag(gamma), the norm's
weight set to ones) gives the same product in exact arithmetic; the FP8 rounding then meets
x_hat, whose channels are on one scale, and a weight whose per-output-channel scale takes gamma
in. `alpha` folds gamma ** alpha and leaves gamma ** (1 - alpha) in the norm (SmoothQuant's
migration strength, with the norm's weight standing in for the activations' channel maxima:
no calibration data). The same kernels and shapes would run on the GPU.

Each variant: the bf16 model (unfolded, unquantized) as the baseline; projections' weights
rounded to E4M3 per output channel and their inputs per token (`fp8_weight_format.fake_quant`).
Perplexity over the texts as `llmserve bench accuracy` reads them (its `read_text`).

    python scripts/studies/fp8_norm_folding.py --text docs/architecture.md docs/reliability.md
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_weight_format import PROJECTIONS, fake_quant, load_study, study_parser  # noqa: E402

from llmserve.bench.accuracy import read_text  # noqa: E402


def main() -> None:
    ap = study_parser()
    ap.add_argument("--alphas", default="0,0.5,1")
    opts = ap.parse_args()
    model, texts = load_study(opts)
    params = dict(model.named_parameters())
    original = {n: p.detach().clone() for n, p in params.items()}
    pairs = [(layer.input_layernorm, layer.self_attn.qkv_proj) for layer in model.model.layers]
    pairs += [(layer.post_attention_layernorm, layer.mlp.gate_up_proj) for layer in model.model.layers]
    modules = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]

    def nll_per_text() -> dict[str, tuple[float, list[int]]]:
        out = {}
        for name, ids in texts.items():
            r = read_text(model, ids, opts.window, torch.device("cpu"), torch.bfloat16)
            out[name] = (sum(r.nll) / len(r.nll), r.top1)
        return out

    def restore() -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(original[n])

    base = nll_per_text()
    rows: dict[str, dict] = {}
    for alpha in [float(a) for a in opts.alphas.split(",")]:
        started = time.perf_counter()
        restore()
        with torch.no_grad():
            for norm, proj in pairs:
                gamma = norm.weight.float()
                moved = gamma.abs().clamp(min=1e-6) ** alpha * gamma.sign()  # (the sign goes with the weight)
                norm.weight.copy_((gamma / moved).to(norm.weight.dtype))
                proj.weight.copy_((proj.weight.float() * moved[None, :]).to(proj.weight.dtype))
            folded_bf16 = nll_per_text()
            for m in modules:
                m.weight.copy_(fake_quant(m.weight.detach(), torch.float8_e4m3fn, None))
        hooks = [m.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0], torch.float8_e4m3fn, None),))
                 for m in modules]  # fmt: skip
        quantized = nll_per_text()
        for hook in hooks:
            hook.remove()
        per_text = {}
        for t in texts:
            agree = sum(a == b for a, b in zip(quantized[t][1], base[t][1])) / len(base[t][1])
            per_text[t] = {"change_pct": round(100 * (math.exp(quantized[t][0] - base[t][0]) - 1), 3),
                           "folded_bf16_change_pct": round(100 * (math.exp(folded_bf16[t][0] - base[t][0]) - 1), 3),
                           "top1_agreement": round(agree, 4)}  # fmt: skip
        # all positions together (the texts have the same number of positions: a geometric mean)
        change = math.exp(sum(quantized[t][0] - base[t][0] for t in texts) / len(texts)) - 1
        rows[f"alpha {alpha}"] = {"change_pct": round(100 * change, 3), "texts": per_text}
        print(f"alpha {alpha}: perplexity {100 * change:+.2f} % against bf16 "
              f"({ {t.rsplit('/', 1)[-1]: v['change_pct'] for t, v in per_text.items()} }, "
              f"{time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    restore()
    if opts.output_json:
        Path(opts.output_json).write_text(json.dumps({"model": opts.model, "texts": opts.text, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
