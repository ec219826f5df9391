"""FP8 at prefill sizes on the GPU (issue 19's (a) and (c)): where the FP8 engine's non-GEMM
kernels and its GEMMs stand at hundreds to 16,384 tokens a step.

1. SiLU-and-multiply with the per-token FP8 quantization (`silu_and_mul_fp8`): 1.40 s of (c)'s
   22.6 s of GPU time on an H200 (161 µs a call), about twice its bytes at 4.15 TB/s. The
   engine's launch against the same kernel with other row strategies (one pass holding the row,
   or two passes in column blocks) and warps. Every variant's FP8 bytes and scales are compared
   with the reference.
2. The per-token quantization of the o_proj input (`quantize_tokens_fp8`), the same way.
3. `torch._scaled_mm` at 512-16,384 tokens for the four 8B projections: row-wise scales (the
   engine's), with `use_fast_accum`, and per-tensor scales, against bf16, in TFLOP/s.

Every time is the mean of a CUDA graph of 20 calls replayed 10 times. Writes
$OUT/fp8_large_m.json after every row.

    python3 scripts/gpu/fp8_large_m.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from llmserve.kernels.activation import _act_and_mul_fp8_kernel, silu_and_mul, silu_and_mul_fp8  # noqa: E402
from llmserve.kernels.fp8_quant import FP8_MAX, MIN_SCALE, _quantize_rows_kernel, quantize_tokens_fp8  # noqa: E402
from llmserve.model.fp8 import quantize_rows, quantize_tokens  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_gemm_micro import SHAPES, graph_time_us  # noqa: E402  (a CUDA graph of 20 calls, replayed 10 times)

OUT = Path(os.environ.get("OUT", "out"))
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "1,64,512,4096,16384").split(","))
GEMM_TOKENS = tuple(int(t) for t in os.environ.get("GEMM_TOKENS", "512,4096,16384").split(","))
INTER = 14336
FOUND: list[dict] = []


def record(row: dict) -> None:
    print("RESULT", json.dumps(row), flush=True)
    FOUND.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fp8_large_m.json").write_text(json.dumps(FOUND, indent=1))


def silu_variant(x: torch.Tensor, one_pass: bool, block: int, warps: int):
    rows = x.shape[0]
    q = torch.empty((rows, INTER), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    _act_and_mul_fp8_kernel[(rows,)](x, q, s, x.stride(0), q.stride(0), INTER, BLOCK=block, ONE_PASS=one_pass, FP8_MAX=FP8_MAX,
                    MIN_SCALE=MIN_SCALE, ACT="silu", num_warps=warps, USE_GDC=False)  # fmt: skip
    return q, s


def quant_variant(x: torch.Tensor, block: int, warps: int):
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(rows,)](x, q, s, s, cols, x.stride(0), q.stride(0), HAS_STATIC=False, BLOCK=block,
                                   FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=warps, USE_GDC=False)  # fmt: skip
    return q, s


def differing(got, want) -> dict:
    return {"bytes_differing": int((got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum()),
            "scales_differing": int((got[1] != want[1]).sum())}  # fmt: skip


def silu_rows() -> None:
    # (call 1 of 2026-12-02 also timed the division's replacement by the reciprocal as variants here:
    # it is the engine's kernel since)
    variants = [("one_pass", True, 16384, w) for w in (8, 16, 32)]
    variants += [("two_pass", False, b, w) for b in (512, 1024, 2048, 4096) for w in (2, 4, 8) if b // w >= 128]
    for m in TOKENS:
        x = torch.randn(m, 2 * INTER, device="cuda", dtype=torch.bfloat16) * 3
        want = quantize_tokens(silu_and_mul(x))
        engine = silu_and_mul_fp8(x)
        ideal_us = (m * 2 * INTER * 2 + m * INTER) / 4.15e6
        row = {"op": "silu_and_mul_fp8", "M": m, "ideal_us_at_4.15TBps": round(ideal_us, 2),
               "engine_us": round(graph_time_us(lambda: silu_and_mul_fp8(x)), 2),
               **differing((engine.q, engine.scale), want), "variants": []}  # fmt: skip
        for name, one_pass, block, warps in variants:
            cfg = {"kind": name, "block": block, "warps": warps}
            try:
                got = silu_variant(x, one_pass, block, warps)
                cfg.update(differing(got, want))
                cfg["us"] = round(graph_time_us(lambda: silu_variant(x, one_pass, block, warps)), 2)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a finding
                cfg["error"] = f"{type(exc).__name__}: {exc}"[:160]
            row["variants"].append(cfg)
        exact = [v for v in row["variants"] if v.get("bytes_differing") == 0 and "us" in v]
        if exact:
            best = min(exact, key=lambda v: v["us"])
            row["best_exact"] = best
        record(row)


def quant_rows() -> None:
    for m in TOKENS:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        want = quantize_tokens(x)
        row = {"op": "quantize_tokens_fp8", "M": m, "ideal_us_at_4.15TBps": round(m * 4096 * 3 / 4.15e6, 2),
               "engine_us": round(graph_time_us(lambda: quantize_tokens_fp8(x)), 2),
               **differing(quantize_tokens_fp8(x), want), "variants": []}  # fmt: skip
        for block, warps in ((4096, 4), (4096, 8), (4096, 16), (2048, 4), (1024, 4), (1024, 2)):
            cfg = {"block": block, "warps": warps}
            try:
                cfg.update(differing(quant_variant(x, block, warps), want))
                cfg["us"] = round(graph_time_us(lambda: quant_variant(x, block, warps)), 2)
            except Exception as exc:  # noqa: BLE001
                cfg["error"] = f"{type(exc).__name__}: {exc}"[:160]
            row["variants"].append(cfg)
        record(row)


def gemm_rows() -> None:
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_rows(w)
        wqt, wst = quantize_rows(w, per_channel=False)
        one = torch.ones((), device="cuda", dtype=torch.float32)
        for m in GEMM_TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_tokens(x)
            flop = 2 * m * n * k
            row = {"op": "gemm", "proj": name, "M": m, "N": n, "K": k}
            calls = {
                "bf16": lambda: x @ w.t(),
                "rowwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16),
                "rowwise_fast_accum": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(),
                                                               out_dtype=torch.bfloat16, use_fast_accum=True),
                "tensorwise": lambda: torch._scaled_mm(xq, wqt.t(), scale_a=one, scale_b=wst[0, 0],
                                                       out_dtype=torch.bfloat16),
                "tensorwise_fast_accum": lambda: torch._scaled_mm(xq, wqt.t(), scale_a=one, scale_b=wst[0, 0],
                                                                  out_dtype=torch.bfloat16, use_fast_accum=True),
            }  # fmt: skip
            ref = calls["rowwise"]().float()
            # the product of the dequantized operands in float64: what exact accumulation approaches
            exact = ((xq.double() * xs.double()) @ (wq.double() * ws.double()).t()).float()
            # and what FP8 itself costs: the bf16 operands' product in float64 against the FP8 one
            row["fp8_quantization_rms_err"] = round(((exact - (x.double() @ w.double().t()).float()).pow(2).mean().sqrt()
                                                     / exact.pow(2).mean().sqrt()).item(), 6)  # fmt: skip
            for label, fn in calls.items():
                try:
                    out = fn().float()
                    us = graph_time_us(fn)
                    row[label] = {"us": round(us, 2), "tflops": round(flop / us / 1e6, 1)}
                    if label == "rowwise_fast_accum":
                        row[label]["max_rel_diff_vs_rowwise"] = round(
                            ((out - ref).abs().max() / ref.abs().max()).item(), 5
                        )
                    if label.startswith("rowwise"):  # error against float64, relative to the largest output
                        err = (out - exact).abs()
                        row[label]["max_err_vs_f64"] = round((err.max() / exact.abs().max()).item(), 6)
                        row[label]["rms_err_vs_f64"] = round(
                            (err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item(), 6
                        )
                except Exception as exc:  # noqa: BLE001
                    row[label] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
            record(row)


def main() -> None:
    torch.manual_seed(0)
    for part in (silu_rows, quant_rows, gemm_rows):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - the next part still runs
            record({"op": part.__name__, "error": f"{type(exc).__name__}: {exc}"[:300]})


if __name__ == "__main__":
    main()
