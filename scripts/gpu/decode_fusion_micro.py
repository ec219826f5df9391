"""Batch-1 decode of the bf16 8B shape on the GPU (issue 18, (b)): the elementwise ops taken into
their neighbours, each against the ops one by one, checked and timed in CUDA graphs of 20 calls
with weights cycled past the L2 (as the engine's decode step reads them):
- RMSNorm (with the residual add) inside the split-K GEMM of qkv and of gate/up (`norm_linear`)
  against the norm's kernel + the product the engine ran before (`dense_linear`: split-K for qkv,
  cuBLAS for gate/up), with a sweep of the fused form's tiles;
- SiLU-and-multiply inside the down projection (`silu_and_mul_linear`) against the activation's
  kernel + `dense_linear`;
- decode attention of one sequence, split-KV shares combined by the last share (one launch)
  against the reduce kernel (two), for several context lengths and split counts.
Writes $OUT/decode_fusion_micro.json. SWEEP=0 skips the tile sweep.

    python3 scripts/gpu/decode_fusion_micro.py
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
from dense_gemm_micro import cold, copies  # noqa: E402
from fp8_gemm_micro import graph_time_us  # noqa: E402

from llmserve import kernels as K  # noqa: E402
from llmserve.kernels import paged_attention  # noqa: E402
from llmserve.kernels.split_k_gemm import fused_config, rms_norm_gemm_small_m, silu_mul_gemm_small_m  # noqa: E402
from llmserve.model.attention import AttentionMetadata, reference_paged_attention  # noqa: E402
from llmserve.model.layers import norm_linear, silu_and_mul_linear  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
SWEEP = os.environ.get("SWEEP", "1") == "1"
HIDDEN, INTER = 4096, 14336
EPS = 1e-5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return round(((got.float() - want.float()).norm() / want.float().norm()).item(), 6)


def sweep_norm(x, res, nw, w) -> list[dict]:
    n, k = w.shape
    nxt = cold(copies(w))
    found = []
    for block_n in (64, 128):
        for block_k in (64, 128, 256):
            if block_n * block_k > 128 * 128:
                continue
            tiles = -(-n // block_n)
            for programs in (132, 264, 528):
                split_k = max(1, min(-(-k // block_k), -(-programs // tiles)))
                for stages in (3, 4):
                    cfg = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": 4,
                           "num_stages": stages}  # fmt: skip
                    if any(f["config"] == cfg for f in found):
                        continue
                    try:
                        us = graph_time_us(lambda: rms_norm_gemm_small_m(x, res, nw, EPS, nxt(), **cfg))
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                        cfg["error"] = str(exc)[:100]
                        us = float("inf")
                    found.append({"config": cfg, "us": round(us, 2)})
    return sorted(found, key=lambda f: f["us"])[:6]


def products() -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    x = torch.randn(1, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(1, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
    for name, n in (("qkv", 6144), ("gate_up", 2 * INTER)):
        w = (torch.randn(n, HIDDEN, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        want, want_res = norm_linear(x.float(), res.float(), nw.float(), EPS, w.float())
        got, got_res = K.norm_linear(x, res, nw, EPS, w)
        h, _ = K.fused_add_rms_norm(x, res, nw, EPS)
        apart = K.dense_linear(h, w)
        nxt = cold(copies(w))
        row = {"op": f"norm + {name}", "N": n, "K": HIDDEN, "config": fused_config(1, n, HIDDEN),
               "rel_err_fused": rel_err(got, want), "rel_err_apart": rel_err(apart, want),
               "residual_equal": bool(torch.equal(got_res, (x.float() + res.float()).to(torch.bfloat16))),
               "apart_us": round(graph_time_us(lambda: K.dense_linear(K.fused_add_rms_norm(x, res, nw, EPS)[0], nxt())), 2),
               "norm_only_us": round(graph_time_us(lambda: K.fused_add_rms_norm(x, res, nw, EPS)), 2),
               "product_only_us": round(graph_time_us(lambda: K.dense_linear(h, nxt())), 2),
               "fused_us": round(graph_time_us(lambda: K.norm_linear(x, res, nw, EPS, nxt())), 2),
               "fused_no_residual_us": round(graph_time_us(lambda: K.norm_linear(x, None, nw, EPS, nxt())), 2)}  # fmt: skip
        if SWEEP:
            row["sweep_best"] = sweep_norm(x, res, nw, w)
        print("RESULT", json.dumps({k: v for k, v in row.items() if k != "sweep_best"}), flush=True)
        if SWEEP:
            print("  best", row["sweep_best"][:3], flush=True)
        rows.append(row)
    gate_up = torch.randn(1, 2 * INTER, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(HIDDEN, INTER, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    want = silu_and_mul_linear(gate_up.float(), w.float())
    nxt = cold(copies(w))
    act = K.silu_and_mul(gate_up)
    row = {"op": "silu_and_mul + down", "N": HIDDEN, "K": INTER, "config": fused_config(1, HIDDEN, INTER),
           "rel_err_fused": rel_err(K.silu_and_mul_linear(gate_up, w), want),
           "rel_err_apart": rel_err(K.dense_linear(act, w), want),
           "apart_us": round(graph_time_us(lambda: K.dense_linear(K.silu_and_mul(gate_up), nxt())), 2),
           "act_only_us": round(graph_time_us(lambda: K.silu_and_mul(gate_up)), 2),
           "product_only_us": round(graph_time_us(lambda: K.dense_linear(act, nxt())), 2),
           "fused_us": round(graph_time_us(lambda: K.silu_and_mul_linear(gate_up, nxt())), 2)}  # fmt: skip
    print("RESULT", json.dumps(row), flush=True)
    rows.append(row)
    return rows


def attention() -> list[dict]:
    """One decode token of one sequence over a paged bf16 cache (32 query / 8 KV heads, D 128)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    page, blocks = 16, 4096
    cache = torch.randn(2, blocks, page, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    rows = []
    for ctx in (512, 768, 1024, 2048):
        table = torch.randperm(blocks, device="cuda", generator=g)[: 2048 // page].to(torch.int32)[None]
        meta = AttentionMetadata(slot_mapping=torch.full((1,), -1, dtype=torch.long, device="cuda"),
                                 query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                                 seq_lens=torch.tensor([ctx], dtype=torch.int32, device="cuda"), block_tables=table,
                                 max_query_len=1, max_seq_len=2048)  # fmt: skip (captured as the engine captures)
        q = torch.randn(1, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
        kv = torch.zeros(1, 8, 128, device="cuda", dtype=torch.bfloat16)
        want = reference_paged_attention(q.float(), kv.float(), kv.float(), cache.float(), meta, 128**-0.5)
        row = {"ctx": ctx, "default_splits": K.choose_num_splits(1, 8, 2048)}
        for splits in (1, 2, 4, 8, 16):
            for here in (True, False):
                paged_attention.REDUCE_SPLITS_IN_KERNEL = here
                got = K.paged_attention_forward(q, cache, meta, 128**-0.5, num_splits=splits)
                key = f"s{splits}_{'one' if here else 'two'}_launch"
                row[key + "_err"] = rel_err(got, want)
                row[key + "_us"] = round(graph_time_us(lambda: K.paged_attention_forward(q, cache, meta, 128**-0.5,
                                                                                        num_splits=splits)), 2)  # fmt: skip
        paged_attention.REDUCE_SPLITS_IN_KERNEL = True
        print("RESULT", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    result = {"device": torch.cuda.get_device_name(), "products": products(), "attention": attention()}
    (OUT / "decode_fusion_micro.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
