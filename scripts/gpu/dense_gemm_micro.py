"""Batch-1 decode GEMMs of the bf16 8B shape on the GPU (issue 18, (b)): per projection and token
count, cuBLAS (`F.linear`) against the split-K Triton GEMM (`gemm_small_m`) with its default tiles
(`bf16_config`) and a sweep of tiles, slices, warps and stages, and what `dense_linear` (the
model's choice) takes. Every variant is checked against float32 and timed inside a CUDA graph of
20 calls, as decode steps run. Writes $OUT/dense_gemm_micro.json.
TOKENS=1,2,4,8,16 (token counts), SWEEP=0 (no sweep) shorten it.

    python3 scripts/gpu/dense_gemm_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fp8_gemm_micro import graph_time_us  # noqa: E402

from llmserve.kernels.dense_linear import dense_linear  # noqa: E402
from llmserve.kernels.split_k_gemm import bf16_config, gemm_small_m  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # fmt: skip
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "1,2,4,8,16").split(","))
SWEEP = os.environ.get("SWEEP", "1") == "1"
PROGRAMS = (132, 264, 528)


L2_BYTES = 64 << 20  # more than an H200's L2 (50 MB): weights cycled past it are read from HBM


def cold(ws: list[torch.Tensor]):
    """The next of `ws` at each call: copies enough to leave the L2, so every call reads its weight
    from memory as the engine's decode step does (one 33-50 MB matrix called 20 times would stay in
    the 50 MB L2 and read faster than it ever does in the engine: seen on 2026-12-02)."""
    state = {"i": 0}

    def next_weight() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(ws)
        return ws[state["i"]]

    return next_weight


def copies(w: torch.Tensor) -> list[torch.Tensor]:
    return [w] + [w.clone() for _ in range(L2_BYTES // (w.numel() * w.element_size()) + 1)]


def sweep(x: torch.Tensor, w: torch.Tensor) -> list[dict]:
    n, k = w.shape
    nxt = cold(copies(w))
    found = []
    for block_n in (32, 64, 128):
        for block_k in (64, 128, 256):
            if block_n * block_k > 128 * 128:
                continue
            tiles = -(-n // block_n)
            for programs in PROGRAMS:
                split_k = max(1, min(-(-k // block_k), programs // tiles))
                for warps in (4,):
                    for stages in (3, 4):
                        cfg = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": warps,
                               "num_stages": stages}  # fmt: skip
                        if any(f["config"] == cfg for f in found):
                            continue
                        try:
                            us = graph_time_us(lambda: gemm_small_m(x, nxt(), **cfg))
                        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                            cfg["error"] = str(exc)[:100]
                            us = float("inf")
                        found.append({"config": cfg, "us": round(us, 2)})
    return sorted(found, key=lambda f: f["us"])


def gemms() -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            want = F.linear(x.float(), w.float())
            got = gemm_small_m(x, w)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            nxt = cold(copies(w))
            row = {"proj": name, "N": n, "K": k, "M": m, "config": bf16_config(m, n, k),
                   "max_rel_err_split_k": round(err, 5),
                   "max_rel_err_cublas": round(((F.linear(x, w).float() - want).abs().max() / want.abs().max()).item(), 5),
                   "cublas_us": round(graph_time_us(lambda: F.linear(x, nxt())), 2),
                   "split_k_us": round(graph_time_us(lambda: gemm_small_m(x, nxt())), 2),
                   "dense_linear_us": round(graph_time_us(lambda: dense_linear(x, nxt())), 2),
                   "cublas_warm_us": round(graph_time_us(lambda: F.linear(x, w)), 2),
                   "split_k_warm_us": round(graph_time_us(lambda: gemm_small_m(x, w)), 2)}  # fmt: skip
            row["cublas_tb_s"] = round(n * k * 2 / row["cublas_us"] / 1e6, 2)
            row["split_k_tb_s"] = round(n * k * 2 / row["split_k_us"] / 1e6, 2)
            if SWEEP and m == 1 and name not in ("lm_head", "gate_up"):
                found = sweep(x, w)
                row["sweep_best"] = found[:6]
                row["best_tb_s"] = round(n * k * 2 / found[0]["us"] / 1e6, 2)
            print("RESULT", json.dumps({k2: v for k2, v in row.items() if k2 != "sweep_best"}), flush=True)
            if "sweep_best" in row:
                print("  best", row["sweep_best"][:3], flush=True)
            rows.append(row)
    return rows


def main() -> None:
    result = {"device": torch.cuda.get_device_name(), "gemm": gemms()}
    (OUT / "dense_gemm_micro.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
