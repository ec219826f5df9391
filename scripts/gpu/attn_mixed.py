"""Attention of mixed steps on the H200 (8B shape: 32/8 heads, head dim 128, block 16): D decodes
at the front of the batch (context ~1,024-1,152 tokens, as in workload (c)) and P fresh
prefill chunks, as one launch (every sequence in the prefill tiles) and as two launches
(`split_decodes`: the decodes in decode tiles, the chunks in prefill tiles), in a bf16 and an
FP8 KV cache (float16 dots, and the bfloat16 dots they replace), and an FP8 cache with per-layer
key and value scales (calibrated-like: amax x 2 -> 448; checked against the reference too). Also each part alone, and
the PyTorch reference on the smaller cases. The two-launch output is checked against the one-launch
output. Times: median of 10, CUDA events, eager (mixed steps run attention outside graphs).
Writes $OUT/attn_mixed.json.

    python3 scripts/gpu/attn_mixed.py
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_kernels import make_batch  # noqa: E402
from event_timer import median_ms as ms_of  # noqa: E402

from llmserve.kernels import paged_attention, paged_attention_forward, write_kv  # noqa: E402
from llmserve.attention_metadata import FP8_KV, AttentionMetadata, to_cache_dtype  # noqa: E402
from llmserve.model.attention import reference_paged_attention  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
CASES = [  # (decodes, their context range, prefill chunks of 1,024 fresh tokens)
    (600, (1024, 1152), 15), (256, (1024, 1152), 15), (64, (1024, 1152), 15), (16, (1024, 1152), 15),
    (256, (256, 384), 15), (700, (1024, 1152), 2), (32, (300, 700), 1),
]  # fmt: skip


def part(meta: AttentionMetadata, lo: int, hi: int, qlo: int, qhi: int, max_q: int) -> AttentionMetadata:
    qsl = meta.query_start_loc[lo : hi + 1] - qlo
    return AttentionMetadata(meta.slot_mapping[qlo:qhi], qsl, meta.seq_lens[lo:hi], meta.block_tables[lo:hi],
                             max_q, meta.max_seq_len)  # fmt: skip


def main() -> None:
    rng = random.Random(0)
    rows = []
    for kv_dtype, scaled in ((torch.bfloat16, False), (FP8_KV, False), (FP8_KV, True)):
        for decodes, (c_lo, c_hi), chunks in CASES:
            qlens = [1] * decodes + [1024] * chunks
            slens = [rng.randrange(c_lo, c_hi) for _ in range(decodes)] + [1024] * chunks
            q, k, v, cache, meta = make_batch(qlens, slens, randn_cache=False)
            write_kv(k, v, cache, meta.slot_mapping)
            kv_scales = (1.0, 1.0)
            if scaled:  # the cache holds key / k_scale and value / v_scale
                kv_scales = (float(cache[0].abs().amax()) * 2 / 448, float(cache[1].abs().amax()) * 2 / 448)
                cache = torch.stack([to_cache_dtype(cache[i], kv_dtype, kv_scales[i]) for i in (0, 1)])
            elif kv_dtype != torch.bfloat16:
                cache = cache.clamp(-448, 448).to(kv_dtype)
            meta.num_decode_seqs = decodes
            scale = 128**-0.5
            kw = {"kv_scales": kv_scales}
            one = paged_attention_forward(q, cache, meta, scale, split_decodes=False, **kw)
            two = paged_attention_forward(q, cache, meta, scale, split_decodes=True, **kw)
            err = (one.float() - two.float()).abs().max().item()
            t_one = ms_of(lambda: paged_attention_forward(q, cache, meta, scale, split_decodes=False, **kw))
            t_two = ms_of(lambda: paged_attention_forward(q, cache, meta, scale, split_decodes=True, **kw))
            dmeta = part(meta, 0, decodes, 0, decodes, 1)
            pmeta = part(meta, decodes, decodes + chunks, decodes, len(q), 1024)
            qd, qp = q[:decodes].contiguous(), q[decodes:].contiguous()
            t_dec = ms_of(lambda: paged_attention_forward(qd, cache, dmeta, scale, **kw))
            t_pre = ms_of(lambda: paged_attention_forward(qp, cache, pmeta, scale, **kw))
            if kv_dtype == FP8_KV and not scaled:  # the same with the FP8 cache read back as bfloat16
                paged_attention.FP8_KV_DOT_F16 = False
                t_two_bf16 = ms_of(lambda: paged_attention_forward(q, cache, meta, scale, split_decodes=True))
                t_dec_bf16 = ms_of(lambda: paged_attention_forward(qd, cache, dmeta, scale))
                paged_attention.FP8_KV_DOT_F16 = True
            if decodes + chunks <= 300:  # against the PyTorch reference (float32 inside)
                ref = reference_paged_attention(q.float(), k.float(), v.float(), cache.clone(), meta, scale, **kw)
                ref_err = (two.float() - ref).abs().max().item()
            kv_bytes = sum(slens[:decodes]) * 8 * 128 * 2 * cache.element_size()
            row = {"kv": str(kv_dtype).replace("torch.", "") + (" scaled" if scaled else ""), "decodes": decodes,
                   "context": [c_lo, c_hi],
                   "prefill_chunks": chunks, "one_launch_ms": round(t_one, 3), "two_launches_ms": round(t_two, 3),
                   "decodes_alone_ms": round(t_dec, 3), "prefill_alone_ms": round(t_pre, 3),
                   "decode_kv_tb_s": round(kv_bytes / t_dec / 1e9, 2), "max_abs_diff": err}  # fmt: skip
            if decodes + chunks <= 300:
                row["max_abs_err_vs_reference"] = ref_err
            if kv_dtype == FP8_KV and not scaled:
                row["two_launches_bf16_dots_ms"] = round(t_two_bf16, 3)
                row["decodes_alone_bf16_dots_ms"] = round(t_dec_bf16, 3)
            print("RESULT", json.dumps(row), flush=True)
            rows.append(row)
            (OUT / "attn_mixed.json").write_text(json.dumps(rows, indent=1))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
