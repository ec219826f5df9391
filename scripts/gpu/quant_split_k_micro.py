"""Split-K at decode for the quantized GEMMs (issue 57, llmserve/kernels/quant_split_k.py): per
kernel (INT8 W8A8, W4A16 group 128, GGUF Q4_K / Q8_0 kept quantized), shape and token count, the
kernel unsplit (`split_k=1`, the kernel before split-K) against the `SPLIT_K_RULE` default and a
sweep of slice counts, beside bf16 `x @ w.T` (cuBLAS) for scale. Every variant is timed inside a
CUDA graph (20 calls a replay), as the engine runs decode steps; each split result is checked
against the unsplit one (INT8: the same bits; the others: float32 rounding before the output's).
Writes $OUT/quant_split_k_micro.json (a row a kernel, shape and M, written after every row).
TOKENS=1,4,16, SHAPES=4096x4096,4096x14336 (N x K), KERNELS=int8,w4a16,q4_k,q8_0 and
SPLITS=1,2,4,8,16,32 narrow or widen it.

    python3 scripts/gpu/quant_split_k_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from event_timer import graph_time_us  # noqa: E402  (a CUDA graph of 20 calls, replayed 10 times)

from llmserve.kernels import gguf_linear, int8_linear, w4a16_linear  # noqa: E402
from llmserve.kernels.quant_split_k import split_k_count  # noqa: E402

TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "1,4,16").split(","))
SHAPES = tuple(tuple(int(d) for d in s.split("x")) for s in os.environ.get("SHAPES", "4096x4096,4096x14336").split(","))
KERNELS = tuple(os.environ.get("KERNELS", "int8,w4a16,q4_k,q8_0").split(","))
SPLITS = tuple(int(t) for t in os.environ.get("SPLITS", "1,2,4,8,16,32").split(","))


def int8_case(n: int, k: int, m: int):
    """(call taking split_k, weight bytes, the rule's slice count) for INT8 W8A8."""
    from llmserve.model.int8 import quantize_rows_int8, quantize_tokens_int8

    wq, sw = quantize_rows_int8(torch.randn(n, k, device="cuda") * 0.05)
    xq, sx = quantize_tokens_int8(torch.randn(m, k, device="cuda") * 4)
    rule = split_k_count(int8_linear.SPLIT_K_RULE, m, -(-k // 128), -(-m // 16) * -(-n // 64))
    return (lambda s: int8_linear.int8_gemm_triton(xq, sx, wq, sw, torch.bfloat16, split_k=s)), n * k, rule


def w4a16_case(n: int, k: int, m: int):
    from llmserve.model.w4a16 import pack_rows
    from llmserve.model.w4a16_checkpoint import quantize_groups

    q, scales, zeros, g_idx = quantize_groups(torch.randn(n, k) * 0.05, 128, False, False)
    args = [t.cuda() for t in (pack_rows(q), scales.to(torch.float16), zeros, g_idx)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rule = split_k_count(w4a16_linear.SPLIT_K_RULE, m, -(-k // 64), -(-m // 16) * -(-n // 64))
    return (lambda s: w4a16_linear.w4a16_gemm_triton(x, *args, split_k=s)), n * k // 2, rule


def gguf_case(type_name: str):
    def case(n: int, k: int, m: int):
        from llmserve.model.gguf.quantize import quantize  # (gguf: scripts/gpu/fetch_wheels.sh)
        from llmserve.model.gguf_linear import GGUFBlocks

        raw = torch.from_numpy(quantize(torch.randn(n, k).numpy(), type_name).view(np.uint8).reshape(n, -1).copy())
        piece = GGUFBlocks(type_name, n, k)
        piece.load_raw(raw)
        fields = {name: t.cuda() for name, t in piece.fields().items()}
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        steps = k // gguf_linear._STEP[type_name]
        rule = split_k_count(gguf_linear.SPLIT_K_RULE, m, steps, -(-m // 16) * -(-n // 64))
        return (lambda s: gguf_linear.gguf_gemm_triton(x, type_name, fields, out, split_k=s)), raw.numel(), rule

    return case


CASES = {"int8": int8_case, "w4a16": w4a16_case, "q4_k": gguf_case("Q4_K"), "q8_0": gguf_case("Q8_0")}


def measure(kernel: str, n: int, k: int, m: int) -> dict:
    row: dict = {"kernel": kernel, "N": n, "K": k, "M": m}
    call, weight_bytes, rule = CASES[kernel](n, k, m)
    unsplit = call(1).float().clone()
    scale = unsplit.abs().max().clamp(min=1e-6)
    row["rule_split_k"] = rule
    row["unsplit_us"] = round(graph_time_us(lambda: call(1)), 2)
    row["rule_us"] = round(graph_time_us(lambda: call(None)), 2)
    row["rule_speedup"] = round(row["unsplit_us"] / row["rule_us"], 3)
    row["rule_max_rel_diff_vs_unsplit"] = round(((call(None).float() - unsplit).abs().max() / scale).item(), 6)
    row["weight_gb_per_s_unsplit"] = round(weight_bytes / row["unsplit_us"] / 1e3, 0)
    row["weight_gb_per_s_rule"] = round(weight_bytes / row["rule_us"] / 1e3, 0)
    sweep = []
    for s in SPLITS:
        try:
            sweep.append({"split_k": s, "us": round(graph_time_us(lambda s=s: call(s)), 2),
                          "max_rel_diff_vs_unsplit": round(((call(s).float() - unsplit).abs().max() / scale).item(), 6)})  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a failing count is a finding, not the end
            sweep.append({"split_k": s, "error": f"{type(exc).__name__}: {exc}"[:200]})
    row["sweep"] = sweep
    timed = [c for c in sweep if "us" in c]
    if timed:
        best = min(timed, key=lambda c: c["us"])
        row["best_split_k"], row["best_us"] = best["split_k"], best["us"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    row["bf16_cublas_us"] = round(graph_time_us(lambda: x @ w.t()), 2)
    return row


def main() -> None:
    torch.manual_seed(0)
    rows = []
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    print("device:", torch.cuda.get_device_name(), flush=True)
    for kernel in KERNELS:
        for n, k in SHAPES:
            for m in TOKENS:
                try:
                    row = measure(kernel, n, k, m)
                except Exception as exc:  # noqa: BLE001 - one failing case is a finding, not the end
                    row = {"kernel": kernel, "N": n, "K": k, "M": m, "error": f"{type(exc).__name__}: {exc}"[:300]}
                print("RESULT", json.dumps({key: v for key, v in row.items() if key != "sweep"}), flush=True)
                rows.append(row)
                (out / "quant_split_k_micro.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
