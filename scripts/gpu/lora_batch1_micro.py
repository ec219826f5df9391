"""What one projection's adapter costs at batch 1 on the GPU, piece by piece (issue 22, the 1.1x
target), run on the device machine. Llama-3.1-8B shapes, 8 slots of rank 16, one token on slot 3,
bf16, each timing 20 calls in one CUDA graph (scripts/gpu/lora_kernels_check.py `time_ms`):

- the base GEMM, and the base GEMM with the adapters' A of every slot appended as extra output
  rows (one cuBLAS call that would give y and every slot's shrink at once);
- the shrink at several K splits, K blocks and warp counts; the expand at several column blocks
  and warp counts; the zeroed buffer and the add of the overlapped path alone;
- the whole projection in order, overlapped (with its own add: the engine's default adds o's,
  gate/up's and down's delta in the next op instead, lora/deferred.py, which one projection
  alone cannot show), and as the appended GEMM + expand (an idea measured on 2026-12-02 and not
  kept: docs/benchmarks.md).
Writes $OUT/lora_batch1_micro.json.

    python3 scripts/gpu/lora_batch1_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lora_kernels_check import DEV, PROJ, SLOTS, time_ms, weights  # noqa: E402

from llmserve.kernels.lora import lora_expand, lora_shrink  # noqa: E402
from llmserve.lora.apply import LoRALinear  # noqa: E402
from llmserve.lora.context import LoRAContext  # noqa: E402
from llmserve.lora.ops import triton_lora_ops  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))


def us(fn) -> float:
    return round(time_ms(fn) * 1000, 2)


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    gen = torch.Generator(device=DEV).manual_seed(5)
    side = torch.cuda.Stream(DEV)
    rows = []
    for name, (in_features, widths) in PROJ.items():
        out = sum(widths)
        w = weights(in_features, widths, torch.bfloat16, gen)
        base = torch.nn.Linear(in_features, out, bias=False, device=DEV, dtype=torch.bfloat16)
        extra = SLOTS * len(widths) * w.a.shape[2]
        w_ext = torch.cat([base.weight.data, w.a.reshape(extra, in_features)])
        ctx = LoRAContext(256, SLOTS, DEV, always_apply=True)
        ctx.set_token_slots([3])
        batch = ctx.batch(1)
        x = torch.randn(1, in_features, generator=gen, device=DEV).to(torch.bfloat16)
        plain = LoRALinear(base, w, ctx, triton_lora_ops())
        over = LoRALinear(base, w, ctx, triton_lora_ops(overlap_max_tokens=1), side=side)
        row = {"proj": name, "extra_rows": extra}
        with torch.inference_mode():
            row["base"] = us(lambda: F.linear(x, base.weight))
            row["base_ext"] = us(lambda: F.linear(x, w_ext))
            row["in_order"] = us(lambda: plain(x))
            row["overlapped"] = us(lambda: over(x))
            y = F.linear(x, base.weight)
            delta = torch.zeros(1, out, dtype=torch.float32, device=DEV)
            row["zeros"] = us(lambda: torch.zeros(1, out, dtype=torch.float32, device=DEV))
            row["add"] = us(lambda: y.add_(delta))
            t = lora_shrink(x, w.a, w.scaling, batch)
            row["default_splits"] = t.shape[0]
            row["expand_default"] = us(lambda: lora_expand(y, t, w.b, w.slice_offsets, w.max_slice_width, batch))
            for bk, sp in ((64, None), (64, 32), (64, 64), (128, 8), (128, 16), (128, 32), (256, 4), (256, 8), (256, 16)):
                for nw in (2, 4):
                    if sp is not None and sp * bk > in_features:
                        continue
                    key = f"shrink_k{bk}_s{sp or 'd'}_w{nw}"
                    row[key] = us(lambda bk=bk, sp=sp, nw=nw: lora_shrink(x, w.a, w.scaling, batch, block_k=bk, splits=sp,
                                                                            num_warps=nw))  # fmt: skip
            for sp in (1, 4, 16):
                ts = lora_shrink(x, w.a, w.scaling, batch, splits=sp)
                for bn in (32, 64, 128, 256):
                    for nw in (1, 2, 4):
                        row[f"expand_s{ts.shape[0]}_n{bn}_w{nw}"] = us(lambda ts=ts, bn=bn, nw=nw: lora_expand(
                            y, ts, w.b, w.slice_offsets, w.max_slice_width, batch, block_n=bn, num_warps=nw))
            t1 = lora_shrink(x, w.a, w.scaling, batch, splits=1)

            def ext_then_expand():
                full = F.linear(x, w_ext)
                lora_expand(full[:, :out], t1, w.b, w.slice_offsets, w.max_slice_width, batch)
                return full

            row["ext_gemm_then_expand"] = us(ext_then_expand)
        rows.append(row)
        print("RESULT", json.dumps(row), flush=True)
    (OUT / "lora_batch1_micro.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
