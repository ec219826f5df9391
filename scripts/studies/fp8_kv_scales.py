"""What scales would buy an FP8 KV cache on a small model (issue 19): a study on the CPU.

`--kv-cache-dtype fp8` stores keys and values in E4M3 with scale 1. E4M3 has 3 mantissa bits
from 2^-6 up to 448 and only subnormals below 2^-6, so values far from that range lose more
than the format's 1/16. This study rounds each layer's new keys and values to E4M3 and back
("fake quant", the cache kept in bf16) under several scalings, with bf16 weights and with the
projections fake-quantized as `--quantization fp8` does (last layer's down_proj kept in bf16,
as `--quantization-ignore` allows):

- scale 1 (what the engine does today);
- one scale per layer for keys and one for values, calibrated on a text not among those read
  (amax over it / 448): what a checkpoint's `k_scale` / `v_scale` or a calibration pass gives;
- per token and KV head (dynamic; the finest, an upper bound that needs a scale per slot).

    python scripts/studies/fp8_kv_scales.py --text docs/architecture.md docs/reliability.md \
        --calibration README.md
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

import llmserve.model.attention as attention  # noqa: E402
from llmserve.bench.accuracy import read_text  # noqa: E402

E4M3 = torch.float8_e4m3fn
TOP = 448.0


def round_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale rounded to E4M3 (saturating), times scale, in x's dtype."""
    y = (x.float() / scale).clamp(-TOP, TOP).to(E4M3).float() * scale
    return y.to(x.dtype)


def main() -> None:
    ap = study_parser()
    ap.add_argument("--calibration", default="README.md", help="the text the per-layer scales come from")
    opts = ap.parse_args()
    opts.text = [*opts.text, opts.calibration]
    model, texts = load_study(opts)
    calib_ids = texts.pop(opts.calibration)
    opts.text = opts.text[:-1]
    original_write = attention.write_kv_cache
    layers = model.attention_layers()
    state = {"layer": 0, "mode": "bf16", "amax": None}

    def write(k, v, kv_cache, slot_mapping):
        i = state["layer"] % len(layers)
        state["layer"] += 1
        mode = state["mode"]
        if mode == "calibrate":  # running amax per layer, per KV head
            a = torch.stack([k.float().abs().amax(dim=(0, 2)), v.float().abs().amax(dim=(0, 2))])  # [2, Hkv]
            state["amax"][i] = a if state["amax"][i] is None else torch.maximum(state["amax"][i], a)
        elif mode == "scale 1":
            k, v = round_e4m3(k, 1.0), round_e4m3(v, 1.0)
        elif mode == "per layer":
            a = state["amax"][i].amax(dim=1) / TOP
            k, v = round_e4m3(k, a[0]), round_e4m3(v, a[1])
        elif mode == "per token and head":
            k = round_e4m3(k, k.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / TOP)
            v = round_e4m3(v, v.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / TOP)
        original_write(k, v, kv_cache, slot_mapping)

    attention.write_kv_cache = write

    def mean_nll() -> float:  # the texts' mean NLL (equal position counts: a geometric mean of perplexities)
        state["layer"] = 0
        return sum(sum(r.nll) / len(r.nll) for r in (read_text(model, ids, opts.window, torch.device("cpu"),
                                                                 torch.bfloat16) for ids in texts.values())) / len(texts)  # fmt: skip

    state["mode"], state["amax"] = "calibrate", [None] * len(layers)
    read_text(model, calib_ids, opts.window, torch.device("cpu"), torch.bfloat16)
    stats = {f"layer {i}": {"k_amax": round(float(a[0].max()), 3), "v_amax": round(float(a[1].max()), 3)}
             for i, a in enumerate(state["amax"])}  # fmt: skip
    print("calibrated amax (k, v) per layer:", [(s["k_amax"], s["v_amax"]) for s in stats.values()], flush=True)

    modules = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS}
    original = {n: m.weight.detach().clone() for n, m in modules.items()}
    last_down = f"model.layers.{len(layers) - 1}.mlp.down_proj"
    rows: dict[str, dict[str, float]] = {}
    state["mode"] = "bf16"
    base = mean_nll()
    for weights in ("bf16", "fp8 (last down_proj bf16)"):
        hooks = []
        if weights != "bf16":
            with torch.no_grad():
                for n, m in modules.items():
                    if n != last_down:
                        m.weight.copy_(fake_quant(original[n], E4M3, None))
                        hooks.append(m.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0], E4M3, None),)))
        for mode in ("bf16", "scale 1", "per layer", "per token and head")[weights == "bf16" :]:
            started = time.perf_counter()
            state["mode"] = mode
            change = 100 * (math.exp(mean_nll() - base) - 1)
            rows[f"weights {weights}, KV {mode}"] = {"change_pct": round(change, 3)}
            print(
                f"weights {weights}, KV {mode}: perplexity {change:+.2f} % ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for n, m in modules.items():
                m.weight.copy_(original[n])
    attention.write_kv_cache = original_write
    if opts.output_json:
        Path(opts.output_json).write_text(json.dumps({"model": opts.model, "texts": opts.text, "calibration": opts.calibration,
                                                      "amax": stats, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
