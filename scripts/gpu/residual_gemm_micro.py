"""Does adding the residual inside the GEMM (cuBLAS's C input, beta 1: `torch.addmm(residual, x, W^T)`)
beat the GEMM and then the fused add-and-RMSNorm kernel, for the 8B's o_proj (4096 x 4096) and
down_proj (4096 x 14336) at the headline rows' token counts? The norm after the GEMM then reads one
tensor instead of two and writes one instead of two: at 7,680 tokens each norm moves 126 MB less.

Per shape and token count, each variant as a chain of CALLS (GEMM, norm) pairs between two CUDA
events (the weights alternated between two copies so no call finds its weight in the L2), median of
REPS chains, ms per pair:
- `unfused`: `dense_linear(x, W)`, then `kernels.fused_add_rms_norm(y, residual, w)` (what runs now);
- `addmm`: `torch.addmm(residual, x, W^T)`, then `kernels.rms_norm(h, w)`;
- `addmm_inplace`: the same with `out=residual`.
Each variant's normed output and new residual are checked against float32 arithmetic; the error of
each is written beside the time. Writes $OUT/residual_gemm_micro.json.

    TOKENS=16,128,512,1000,2048,7680,16384 python3 scripts/gpu/residual_gemm_micro.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmserve import kernels  # noqa: E402
from llmserve.kernels.dense_linear import dense_linear  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "16,128,512,1000,2048,7680,16384").split(","))
SHAPES = {"o": (4096, 4096), "down": (4096, 14336)}
CALLS, REPS, EPS = 20, 7, 1e-5


def chain_ms(fn) -> float:
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(CALLS):
            fn(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": CALLS, "rows": []}
    for name, (out_f, in_f) in SHAPES.items():
        ws = [torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16) * in_f**-0.5 for _ in range(2)]
        norm_w = (1 + 0.1 * torch.randn(out_f, device=dev)).to(torch.bfloat16)
        for tokens in TOKENS:
            x = torch.randn(tokens, in_f, device=dev, dtype=torch.bfloat16)
            res = torch.randn(tokens, out_f, device=dev, dtype=torch.bfloat16)
            scratch = res.clone()

            def unfused(i: int):
                return kernels.fused_add_rms_norm(dense_linear(x, ws[i & 1]), res, norm_w, EPS)

            def addmm(i: int):
                h = torch.addmm(res, x, ws[i & 1].t())
                return kernels.rms_norm(h, norm_w, EPS), h

            def addmm_inplace(i: int):
                h = torch.addmm(scratch, x, ws[i & 1].t(), out=scratch)
                return kernels.rms_norm(h, norm_w, EPS), h

            # float32 truth for weight 0
            h32 = x.float() @ ws[0].float().t() + res.float()
            n32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.float()
            row = {"proj": name, "tokens": tokens}
            for label, fn in (("unfused", unfused), ("addmm", addmm), ("addmm_inplace", addmm_inplace)):
                scratch.copy_(res)
                normed, h = fn(0)
                row[f"{label}_err_residual"] = float((h.float() - h32).abs().max())
                row[f"{label}_err_normed"] = float((normed.float() - n32).abs().max())
                row[f"{label}_ms"] = round(chain_ms(fn), 4)
            row["saving_ms"] = round(row["unfused_ms"] - min(row["addmm_ms"], row["addmm_inplace_ms"]), 4)
            results["rows"].append(row)
            print(f"RESULT {name} {tokens}: unfused {row['unfused_ms']:.4f} addmm {row['addmm_ms']:.4f} "
                  f"inplace {row['addmm_inplace_ms']:.4f} ms (saves {row['saving_ms']:.4f}); err residual "
                  f"{row['unfused_err_residual']:.4f}/{row['addmm_err_residual']:.4f}, normed "
                  f"{row['unfused_err_normed']:.4f}/{row['addmm_err_normed']:.4f}", flush=True)
    (OUT / "residual_gemm_micro.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
