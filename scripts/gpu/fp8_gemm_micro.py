"""Where FP8 linear layers spend their time on the GPU (issue 19): per 8B-shape projection and
token count, bf16 `x @ w.T` against the FP8 path (`quantize_tokens` then `torch._scaled_mm`
with row-wise scales), each FP8 part alone, the fused quantization kernel (checked bit for
bit against the torch ops) and, for few tokens, the split-K Triton FP8 GEMM. Every variant is timed inside a CUDA graph
(20 calls a replay), as the engine runs decode steps, so launch costs do not count twice.
The FP8 result is checked against the float32 reference. First, the RMSNorm and SiLU-and-
multiply kernels that quantize in their pass against the unfused kernels then the
quantization (bytes and time). Writes $OUT/fp8_gemm_micro.json.
TOKENS=1,16 (token counts), SWEEP=0 (skip the split-K configuration sweep) and SWEEP_BN /
SWEEP_BK / SWEEP_WARPS (the sweep's tile widths, depths and warps) shorten it.

    python3 scripts/gpu/fp8_gemm_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from event_timer import graph_time_us  # noqa: E402  (a CUDA graph of 20 calls, replayed 10 times)

from llmserve.kernels.activation import silu_and_mul, silu_and_mul_fp8  # noqa: E402
from llmserve.kernels.fp8_linear import fp8_gemm_fast  # noqa: E402
from llmserve.kernels.fp8_quant import quantize_tokens_fp8  # noqa: E402
from llmserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_fp8  # noqa: E402
from llmserve.kernels.split_k_gemm import MAX_M, fp8_gemm_small_m  # noqa: E402
from llmserve.model.fp8 import fp8_matmul_reference, quantize_rows, quantize_tokens  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "1,16,32,64,128,512,2048,8192").split(","))
SWEEP = os.environ.get("SWEEP", "1") == "1"  # the split-K kernel's configurations at few tokens
# the sweep's grid (SWEEP_BN=64,128 SWEEP_BK=128,256 SWEEP_WARPS=4 narrow it)
SWEEP_BN = tuple(int(t) for t in os.environ.get("SWEEP_BN", "32,64,128").split(","))
SWEEP_BK = tuple(int(t) for t in os.environ.get("SWEEP_BK", "128,256").split(","))
SWEEP_WARPS = tuple(int(t) for t in os.environ.get("SWEEP_WARPS", "4,8").split(","))


def sweep_small_m(xq, xs, wq, ws) -> list[dict]:
    """The split-K kernel's tile sizes, slice counts and warps: microseconds per call of each."""
    n, k = wq.shape
    found = []
    for block_n in SWEEP_BN:
        for block_k in SWEEP_BK:
            tiles_n = -(-n // block_n)
            auto = max(1, min(-(-k // block_k), 512 // tiles_n))
            for split_k in sorted({auto, 2 * auto, max(1, auto // 2), 4 * auto}):
                for warps in SWEEP_WARPS:
                    cfg = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": warps}
                    try:
                        us = graph_time_us(lambda: fp8_gemm_small_m(xq, xs, wq, ws, torch.bfloat16, **cfg))
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                        cfg["error"] = str(exc)[:100]
                        us = float("inf")
                    found.append({"config": cfg, "us": round(us, 2)})
    return found


def fused_rows() -> list[dict]:
    """RMSNorm with the residual and SiLU-and-multiply that quantize in their pass, against the
    unfused kernel then `quantize_tokens_fp8`: the same FP8 bytes and scales, and the time."""
    found = []
    for m in TOKENS:
        x, res = (torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
        gate_up = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
        for name, fused, unfused in (
            ("add_rms_norm", lambda: fused_add_rms_norm_fp8(x, res, w, 1e-5)[0],
             lambda: quantize_tokens_fp8(fused_add_rms_norm(x, res, w, 1e-5)[0])),
            ("silu_and_mul", lambda: silu_and_mul_fp8(gate_up), lambda: quantize_tokens_fp8(silu_and_mul(gate_up))),
        ):  # fmt: skip
            got, want = fused(), unfused()
            row = {"op": name, "M": m,
                   "bytes_differing": int((got.q.view(torch.uint8) != want[0].view(torch.uint8)).sum()),
                   "scales_differing": int((got.scale != want[1]).sum()),
                   "fused_us": round(graph_time_us(fused), 2), "unfused_us": round(graph_time_us(unfused), 2)}  # fmt: skip
            print("RESULT", json.dumps(row), flush=True)
            found.append(row)
    return found


def main() -> None:
    torch.manual_seed(0)
    try:
        rows = fused_rows()
    except Exception as exc:  # noqa: BLE001 - the GEMM rows still run
        rows = [{"op": "fused", "error": f"{type(exc).__name__}: {exc}"[:300]}]
        print("RESULT", json.dumps(rows[0]), flush=True)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_rows(w)
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_tokens(x)
            row = {"proj": name, "N": n, "K": k, "M": m}
            try:
                out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
                ref = fp8_matmul_reference(x, wq, ws)
                row["max_rel_err_vs_reference"] = round(((out.float() - ref.float()).abs().max() /
                                                         ref.float().abs().max()).item(), 5)  # fmt: skip
                row["bf16_us"] = round(graph_time_us(lambda: x @ w.t()), 2)
                row["quant_us"] = round(graph_time_us(lambda: quantize_tokens(x)), 2)
                row["scaled_mm_us"] = round(
                    graph_time_us(
                        lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
                    ),
                    2,
                )
                row["fp8_total_us"] = round(row["quant_us"] + row["scaled_mm_us"], 2)
                # the fused quantization kernel (llmserve/kernels/fp8_quant.py): bytes as the reference's
                fq, fs = quantize_tokens_fp8(x)
                row["fused_quant_bytes_differing"] = int((fq.view(torch.uint8) != xq.view(torch.uint8)).sum())
                row["fused_quant_scales_differing"] = int((fs != xs).sum())
                row["fused_quant_us"] = round(graph_time_us(lambda: quantize_tokens_fp8(x)), 2)
                row["fp8_fused_total_us"] = round(row["fused_quant_us"] + row["scaled_mm_us"], 2)
                if m <= MAX_M:  # the split-K Triton GEMM for few tokens (llmserve/kernels/fp8_gemm.py)
                    small = fp8_gemm_small_m(xq, xs, wq, ws, torch.bfloat16)
                    row["small_m_max_rel_err_vs_reference"] = round(((small.float() - ref.float()).abs().max() /
                                                                     ref.float().abs().max()).item(), 5)  # fmt: skip
                    row["small_m_us"] = round(
                        graph_time_us(lambda: fp8_gemm_small_m(xq, xs, wq, ws, torch.bfloat16)), 2
                    )
                    row["weight_gb_per_s_small_m"] = round(n * k / row["small_m_us"] / 1e3, 0)
                    if SWEEP:
                        row["small_m_sweep"] = sweep_small_m(xq, xs, wq, ws)
                        best = min(row["small_m_sweep"], key=lambda c: c["us"])
                        row["small_m_best_us"], row["small_m_best"] = best["us"], best["config"]
                row["fast_path_us"] = round(graph_time_us(lambda: fp8_gemm_fast(xq, xs, wq, ws, torch.bfloat16)), 2)
                row["fp8_over_bf16"] = round(row["fp8_total_us"] / row["bf16_us"], 3)
                row["weight_gb_per_s_bf16"] = round(n * k * 2 / row["bf16_us"] / 1e3, 0)
                row["weight_gb_per_s_fp8_mm"] = round(n * k / row["scaled_mm_us"] / 1e3, 0)
            except Exception as exc:  # noqa: BLE001 - one failing shape is a finding, not the end
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print("RESULT", json.dumps(row), flush=True)
            rows.append(row)
            out = Path(os.environ.get("OUT", "out"))  # after every row: a time limit keeps what ran
            out.mkdir(parents=True, exist_ok=True)
            (out / "fp8_gemm_micro.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
