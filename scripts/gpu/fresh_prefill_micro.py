"""Could a kernel made for fresh prompts (no cached prefix: keys and values read from the step's own
contiguous k/v, not through the paged cache's block table) beat the paged kernel at (c)'s prefill
(16 prompts x 1,024 tokens a step: 0.558 ms a layer, 247 TFLOP/s, against cuDNN's 0.288 for the
same prompts as one batched call)? The FlashAttention-2-style kernel of
llmserve/kernels/fresh_prefill.py (`config=` forcing its tiles), swept over tiles, warps and
stages, against the engine's paths for the same step (`triton_paged_attention` with the prompts
listed as fresh and the SDPA threshold past them, the KV write included) and cuDNN batched. Each
variant's output is checked against the engine's. Eager timing (prefill attention runs between the
piecewise graphs). Writes $OUT/fresh_prefill_micro.json. (The sweep of 2026-12-04 ran a copy of
the kernel inside this script whose tiles were ordered most keys first over all prompts.)

    python3 scripts/gpu/fresh_prefill_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import event_timer  # noqa: E402

from llmserve.kernels.fresh_prefill import fresh_prefill_attention  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
HQ, HKV, D = 32, 8, 128


def fresh_attention(q, k, v, seqs, cfg, out=None):
    out = torch.empty_like(q) if out is None else out
    return fresh_prefill_attention(q, k, v, tuple(seqs), D**-0.5, out, config=cfg)


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
                out = fresh_attention(q, k, v, seqs, cfg)
                err = float((out.float() - ref.float()).abs().max())
                ms = event_timer.median_ms(lambda: fresh_attention(q, k, v, seqs, cfg, out))
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
