"""Which projections carry FP8's perplexity cost on a small model (issue 19): a study on the CPU,
with fake quantization (`fp8_weight_format.fake_quant`: E4M3 weights per output channel, inputs
per token, as `--quantization fp8` does), leaving one group of projections in bf16 at a time:
one kind (qkv, o, gate/up, down) in every layer, every projection of the first or last layer,
or one projection of the last layer. What each group's share of the cost is, and so what keeping it in bf16 would buy.

    python scripts/studies/fp8_sensitivity.py --text docs/architecture.md docs/reliability.md
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
    opts = ap.parse_args()
    model, texts = load_study(opts)
    modules = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS}
    original = {n: m.weight.detach().clone() for n, m in modules.items()}
    quantized = {n: fake_quant(w, torch.float8_e4m3fn, None) for n, w in original.items()}
    last = len(model.model.layers) - 1

    def mean_nll() -> float:  # the texts' mean NLL (equal position counts: a geometric mean of perplexities)
        return sum(sum(r.nll) / len(r.nll) for r in (read_text(model, ids, opts.window, torch.device("cpu"),
                                                                 torch.bfloat16) for ids in texts.values())) / len(texts)  # fmt: skip

    base = mean_nll()
    groups = {"none (all FP8)": lambda n: False, **{f"{p} in every layer": (lambda n, p=p: n.endswith(p)) for p in PROJECTIONS},
              "layer 0": lambda n: n.startswith("model.layers.0."),
              f"layer {last}": lambda n, last=last: n.startswith(f"model.layers.{last}."),
              **{f"layer {last} {p}": (lambda n, p=p, last=last: n.startswith(f"model.layers.{last}.") and n.endswith(p))
                 for p in PROJECTIONS}}  # fmt: skip
    rows = {}
    for name, keep in groups.items():
        started = time.perf_counter()
        hooks = []
        with torch.no_grad():
            for n, m in modules.items():
                m.weight.copy_(original[n] if keep(n) else quantized[n])
                if not keep(n):
                    hooks.append(
                        m.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0], torch.float8_e4m3fn, None),))
                    )
        change = 100 * (math.exp(mean_nll() - base) - 1)
        for hook in hooks:
            hook.remove()
        kept = sum(original[n].numel() for n in modules if keep(n)) / sum(w.numel() for w in original.values())
        rows[name] = {"change_pct": round(change, 3), "bf16_share_of_projection_weights": round(kept, 4)}
        print(f"bf16 kept: {name}: perplexity {change:+.2f} % ({100 * kept:.1f} % of the projection weights in bf16, "
              f"{time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    with torch.no_grad():
        for n, m in modules.items():
            m.weight.copy_(original[n])
    if opts.output_json:
        Path(opts.output_json).write_text(json.dumps({"model": opts.model, "texts": opts.text, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
