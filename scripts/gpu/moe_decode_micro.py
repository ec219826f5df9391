"""The fused MoE decode variant against the grouped kernels (issue 52, kernels/fused_moe.py), per
shape and token count, each inside a CUDA graph (20 calls a replay) as the engine runs decode
steps, 16-bit and FP8 per-block experts; the decode variant's tiles swept, each result checked
against the grouped kernels'. Writes $OUT/moe_decode_micro.json (a row each, written as it goes):
the numbers `DEFAULT_DECODE` / `TUNED_DECODE` (max_tokens, BLOCK_N, DOWN_BLOCK_N, BLOCK_K) are set from.
TOKENS=1,2,4,8 and SHAPES=qwen3-30b-a3b,mixtral-8x7b narrow or widen it.

    python3 scripts/gpu/moe_decode_micro.py
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from event_timer import graph_time_us  # noqa: E402  (a CUDA graph of 20 calls, replayed 10 times)

from llmserve.kernels import fused_moe as fm  # noqa: E402

# name -> (experts, top_k, hidden, moe_intermediate)
ALL_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-235b-a22b": (128, 8, 4096, 1536),
}
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "1,2,4,8").split(","))
SHAPES = tuple(os.environ.get("SHAPES", "qwen3-30b-a3b,mixtral-8x7b").split(","))


def main() -> None:
    out = Path(os.environ.get("OUT", ".")) / "moe_decode_micro.json"
    rows = []
    card = torch.cuda.get_device_name()
    for name, fp8 in itertools.product(SHAPES, (False, True)):
        experts, top_k, hidden, inter = ALL_SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter**-0.5).bfloat16()
        kw = {}
        if fp8:
            from llmserve.model.fp8_blocks import quantize_blocks

            (w13, s13), (w2, s2) = quantize_blocks(w13, (128, 128)), quantize_blocks(w2, (128, 128))
            kw = dict(w13_scale=s13, w2_scale=s2, block_shape=(128, 128))
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
            logits = torch.randn(tokens, experts, generator=gen, device="cuda").bfloat16()
            ref = fm.fused_moe(x, logits, w13, w2, top_k, True, decode=False, **kw)
            row = dict(card=card, shape=name, fp8=fp8, tokens=tokens,
                       grouped_us=graph_time_us(lambda: fm.fused_moe(x, logits, w13, w2, top_k, True, decode=False, **kw)),
                       decode={})  # fmt: skip
            for bn, down_bn, bk in itertools.product((16, 32, 64), (16, 32, 64), (64, 128, 256)):
                cfg = dict(fm.DEFAULT_DECODE, BLOCK_N=bn, DOWN_BLOCK_N=down_bn, BLOCK_K=bk)
                fm.TUNED_DECODE[fm.shape_key(experts, hidden, inter)] = cfg
                got = fm.fused_moe(x, logits, w13, w2, top_k, True, decode=True, **kw)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                us = graph_time_us(lambda: fm.fused_moe(x, logits, w13, w2, top_k, True, decode=True, **kw))
                row["decode"][f"{bn}/{down_bn}/{bk}"] = dict(us=us, rel_err=err)
            fm.TUNED_DECODE.clear()
            best = min(row["decode"].items(), key=lambda kv: kv[1]["us"])
            row["best_decode"] = dict(tiles=best[0], **best[1])
            row["default_decode_us"] = row["decode"]["32/32/128"]["us"]
            rows.append(row)
            print(f"{name} fp8={fp8} T={tokens}: grouped {row['grouped_us']:.1f} us, decode default "
                  f"{row['default_decode_us']:.1f} us, best {best[0]} {best[1]['us']:.1f} us", flush=True)  # fmt: skip
            out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
