"""Could a kernel made for fresh prompts (no cached prefix: keys and values read from the step's own
contiguous k/v, not through the paged cache's block table) beat the paged kernel at (c)'s prefill
(16 prompts x 1,024 tokens a step: 0.558 ms a layer, 247 TFLOP/s, against cuDNN's 0.288 for the
same prompts as one batched call)? A FlashAttention-2-style Triton kernel (one program per
(BLOCK_M queries of one prompt, one query head); the blocks below the tile's first query without
a mask, the diagonal with it; tiles with the most keys first), swept over tiles, warps and stages,
against the engine's paths for the same step (`triton_paged_attention` with the prompts listed as
fresh and the SDPA threshold past them, the KV write included) and cuDNN batched. Each variant's
output is checked against the engine's. Eager timing (prefill attention runs between the
piecewise graphs). Writes $OUT/fresh_prefill_micro.json.

    python3 scripts/gpu/fresh_prefill_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import event_timer  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
HQ, HKV, D = 32, 8, 128
LOG2E = 1.4426950408889634


@triton.jit
def _fresh_kernel(Q, K, V, O, TILES, sqt, sqh, skt, skh, svt, svh, sot, soh, qk_scale,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    tile = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(TILES + tile * 3)
    m0 = tl.load(TILES + tile * 3 + 1)
    n = tl.load(TILES + tile * 3 + 2)
    kvh = head // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (first + offs_m)[:, None] * sqt + head * sqh + offs_d[None, :], mask=offs_m[:, None] < n, other=0.0)
    k_base = K + first * skt + kvh * skh
    v_base = V + first * svt + kvh * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, m0, BLOCK_N):  # keys below the tile's first query: all visible
        k = tl.load(k_base + (start + offs_n)[None, :] * skt + offs_d[:, None])
        s = tl.dot(q, k) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (start + offs_n)[:, None] * svt + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    for start in range(m0, tl.minimum(m0 + BLOCK_M, n), BLOCK_N):  # the diagonal: causal
        cols = start + offs_n
        k = tl.load(k_base + cols[None, :] * skt + offs_d[:, None], mask=cols[None, :] < n, other=0.0)
        s = tl.dot(q, k) * qk_scale
        s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svt + offs_d[None, :], mask=cols[:, None] < n, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + (first + offs_m)[:, None] * sot + head * soh + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=offs_m[:, None] < n)  # fmt: skip


def tiles_for(seqs: list[tuple[int, int]], block_m: int, device) -> torch.Tensor:
    """(first row, query start, length) per tile of each (first row, length) prompt, most keys first."""
    rows = [(first, m0, n) for first, n in seqs for m0 in range(0, n, block_m)]
    rows.sort(key=lambda r: -r[1])
    return torch.tensor(rows, dtype=torch.int32, device=device)


def fresh_attention(q, k, v, tiles, cfg, out=None):
    bm, bn, warps, stages = cfg
    out = torch.empty_like(q) if out is None else out
    _fresh_kernel[(tiles.shape[0], q.shape[1])](
        q, k, v, out, tiles, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), D**-0.5 * LOG2E, GROUP=q.shape[1] // k.shape[1], BLOCK_M=bm, BLOCK_N=bn,
        HEAD_DIM=D, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def main() -> None:
    from bench_kernels import make_batch, visible_pairs

    from llmserve.kernels import paged_attention as pa

    results = {"device": torch.cuda.get_device_name(), "cases": []}
    configs = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
               if not (bm == 64 and w == 8)]  # fmt: skip
    for count, length in ((16, 1024), (15, 1024), (32, 512), (8, 2048), (4, 1536)):
        q, k, v, cache, meta = make_batch([length] * count, [length] * count, randn_cache=False)
        # q/k/v as the engine has them: views of one fused projection
        qkv = torch.randn(q.shape[0], (HQ + 2 * HKV) * D, device="cuda", dtype=q.dtype)
        q, k, v = (t.view(-1, h, D) for t, h in zip(qkv.split([HQ * D, HKV * D, HKV * D], -1), (HQ, HKV, HKV)))
        meta.fresh_seqs = tuple((i, i * length, length) for i in range(count))
        flops = 4 * HQ * D * visible_pairs([length] * count, [length] * count)
        saved = pa.SDPA_PREFILL_TOKENS
        pa.SDPA_PREFILL_TOKENS = length + 1
        try:
            ref = pa.triton_paged_attention(q, k, v, cache, meta, D**-0.5)
            engine_ms = event_timer.median_ms(lambda: pa.triton_paged_attention(q, k, v, cache, meta, D**-0.5))
        finally:
            pa.SDPA_PREFILL_TOKENS = saved
        case = {"count": count, "length": length, "engine_kernel_ms": round(engine_ms, 4),
                "engine_kernel_tflops": round(flops / engine_ms / 1e9, 1), "variants": []}  # fmt: skip
        qb, kb, vb = (t.reshape(count, length, -1, D).transpose(1, 2) for t in (q, k, v))
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)

            cudnn()
            ms = event_timer.median_ms(cudnn)
            case["cudnn_batched_ms"], case["cudnn_batched_tflops"] = round(ms, 4), round(flops / ms / 1e9, 1)
        except RuntimeError as exc:
            case["cudnn_batched_error"] = str(exc)[:200]
        seqs = [(i * length, length) for i in range(count)]
        for cfg in configs:
            try:
                tiles = tiles_for(seqs, cfg[0], q.device)
                out = fresh_attention(q, k, v, tiles, cfg)
                err = float((out.float() - ref.float()).abs().max())
                ms = event_timer.median_ms(lambda: fresh_attention(q, k, v, tiles, cfg, out))
                case["variants"].append({"cfg": cfg, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                                         "max_abs_err": err})  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (shared memory)
                case["variants"].append({"cfg": cfg, "error": str(exc)[:160]})
        ok = [x for x in case["variants"] if "ms" in x]
        best = min(ok, key=lambda x: x["ms"]) if ok else None
        case["best"] = best
        results["cases"].append(case)
        print(f"RESULT {count}x{length}: engine kernel {engine_ms:.4f} ms ({case['engine_kernel_tflops']}), cuDNN "
              f"batched {case.get('cudnn_batched_ms')} ({case.get('cudnn_batched_tflops')}), fresh best {best}",
              flush=True)  # fmt: skip
        for x in sorted(ok, key=lambda x: x["ms"])[:5]:
            print(f"RESULT   {x}", flush=True)
        del q, k, v, cache, meta, qkv
        torch.cuda.empty_cache()
    (OUT / "fresh_prefill_micro.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
