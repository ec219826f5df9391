"""Does the layout of q/k/v change cuDNN's SDPA time for one fresh prompt (what `sdpa_prefill`
gets in the engine: q, k and v as row views of the fused qkv projection's output, row stride
(Hq + 2 Hkv) x D) against contiguous tensors? 8B heads, bf16, causal, CUDA events, median of
20 calls (event_timer.py). Writes $OUT/sdpa_layout_micro.json.

    python3 scripts/gpu/sdpa_layout_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from event_timer import median_ms  # noqa: E402
from llmserve.kernels.paged_attention import sdpa_prefill  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main() -> None:
    results = {}
    for n in (2048, 7680, 16384):
        qkv = torch.randn(n, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k, v = q.view(n, HQ, D), k.view(n, HKV, D), v.view(n, HKV, D)
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty(n, HQ, D, device="cuda", dtype=torch.bfloat16)
        ref = sdpa_prefill(qc, kc, vc, D**-0.5)
        variants = {
            "views (engine)": lambda: sdpa_prefill(q, k, v, D**-0.5, out),
            "q contiguous, k/v views": lambda: sdpa_prefill(qc, k, v, D**-0.5, out),
            "contiguous": lambda: sdpa_prefill(qc, kc, vc, D**-0.5, out),
            "views + .contiguous() inside": lambda: sdpa_prefill(q.contiguous(), k.contiguous(), v.contiguous(), D**-0.5, out),
        }
        for name, fn in variants.items():
            ms = median_ms(fn, iters=20, warmup=3)
            fn()
            err = (out.float() - ref.float()).abs().max().item()
            results[f"{n} {name}"] = {"ms": round(ms, 4), "tflops": round(4 * HQ * D * n * (n + 1) / 2 / ms / 1e9, 1),
                                      "max_abs_diff": err}  # fmt: skip
            print(n, name, results[f"{n} {name}"], flush=True)
    (Path(os.environ.get("OUT", ".")) / "sdpa_layout_micro.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
