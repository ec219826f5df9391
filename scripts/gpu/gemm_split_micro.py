"""Is cuBLAS slower per row at 16,384 rows than at 7,680 (gemm_tune_micro.py: 671 against 723 TFLOP/s a
layer, 2026-12-04, but 16,384 was timed last, on a warmer GPU), and if so, does a full prefill step's
GEMM run faster as row blocks? The 8B's four projections (qkv, o, gate_up, down) per layer, bf16:
`whole` (one `torch.mm` of all rows), `halves` / `quarters` (the rows in 2 / 4 blocks, each
`torch.mm(..., out=)` into its slice of one output). The token counts are interleaved and repeated
REPS times so that the GPU's warming shows as a trend, not as a shape's cost. CUDA events, median of
CALLS calls, the weights alternated between two copies (no L2 hits across calls). Every variant's
output is compared with `whole`'s. Writes $OUT/gemm_split_micro.json.

    TOKENS=4096,7680,8192,12288,16384 REPS=3 python3 scripts/gpu/gemm_split_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import event_timer  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "4096,7680,8192,12288,16384").split(","))
REPS = int(os.environ.get("REPS", 3))
CALLS = int(os.environ.get("CALLS", 10))
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FLOP_PER_ROW = 2 * sum(o * i for o, i in SHAPES.values())


def layer_fn(x: dict, ws: dict, ys: dict, blocks: int):
    """One layer's four GEMMs of all rows, in `blocks` row blocks; call(i) uses weight copy i & 1."""

    def call(i: int) -> None:
        for name in SHAPES:
            xin, w, y = x[name], ws[name][i & 1], ys[name]
            rows = xin.shape[0]
            step = -(-rows // blocks)
            for start in range(0, rows, step):
                torch.mm(xin[start : start + step], w.t(), out=y[start : start + step])

    return call


def median_ms(fn) -> float:
    """`event_timer.median_ms` of fn(i), i counting calls (the weight copy alternates)."""
    calls = iter(range(10**9))
    return event_timer.median_ms(lambda: fn(next(calls)), iters=CALLS)


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ws = {n: [torch.randn(o, i, device=dev, dtype=torch.bfloat16) * i**-0.5 for _ in range(2)]
          for n, (o, i) in SHAPES.items()}  # fmt: skip
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    inputs = {}
    for tokens in TOKENS:
        x = {n: torch.randn(tokens, i, device=dev, dtype=torch.bfloat16) for n, (_, i) in SHAPES.items()}
        ys = {n: torch.empty(tokens, o, device=dev, dtype=torch.bfloat16) for n, (o, _) in SHAPES.items()}
        inputs[tokens] = (x, ys)
        # correctness: blocks against one GEMM (the same kernel's arithmetic per row: equal, or close)
        layer_fn(x, ws, ys, 1)(0)
        whole = {n: ys[n].clone() for n in SHAPES}
        for blocks in (2, 4):
            layer_fn(x, ws, ys, blocks)(0)
            err = max(float((ys[n].float() - whole[n].float()).abs().max()) for n in SHAPES)
            results.setdefault("max_abs_diff_vs_whole", {})[f"{tokens}x{blocks}"] = err
    for rep in range(REPS):
        for tokens in TOKENS:
            x, ys = inputs[tokens]
            row = {"rep": rep, "tokens": tokens}
            for label, blocks in (("whole", 1), ("halves", 2), ("quarters", 4)):
                ms = median_ms(layer_fn(x, ws, ys, blocks))
                row[f"{label}_ms"] = round(ms, 4)
                row[f"{label}_tflops"] = round(FLOP_PER_ROW * tokens / ms / 1e9, 1)
            results["rows"].append(row)
            print(f"RESULT rep {rep} {tokens}: whole {row['whole_ms']:.3f} ms ({row['whole_tflops']} TFLOP/s), halves "
                  f"{row['halves_ms']:.3f} ({row['halves_tflops']}), quarters {row['quarters_ms']:.3f} "
                  f"({row['quarters_tflops']})", flush=True)
    print(f"RESULT max abs diff against one GEMM: {results['max_abs_diff_vs_whole']}", flush=True)
    (OUT / "gemm_split_micro.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
