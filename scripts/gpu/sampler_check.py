"""The sampler's fast paths on the GPU (issue 18/19, batch-1 decode): the two-stage argmax
(llmserve/engine/argmax.py) against torch.argmax on 128,256-wide rows with ties (indices
equal), the time of each at 1-1,000 rows, and the exponential race with and without the
softmax (argmax of p / E against argmax of logits - log E), then the whole batched sampler's
GPU time a step (step_breakdown.sampler_ms). Times: CUDA events, median of 20.
Writes $OUT/sampler_check.json.

    python3 scripts/gpu/sampler_check.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from event_timer import median_ms  # noqa: E402

from llmserve.engine.argmax import row_argmax  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
VOCAB = 128256


def us_of(fn) -> float:
    return round(median_ms(fn, iters=20, warmup=3) * 1000, 2)


def main() -> None:
    result: dict = {"argmax": [], "race": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 4, 16, 64, 512, 1000):
        x = torch.randn(rows, VOCAB, device="cuda", generator=g)
        x[0, 1000] = x[0, 90000] = 50.0  # a tie across chunks
        if rows > 1:
            x[1, :] = 0.0  # all equal
        equal = bool(torch.equal(row_argmax(x), x.argmax(dim=-1)))
        row = {"rows": rows, "equal": equal, "torch_us": us_of(lambda: x.argmax(dim=-1)),
               "row_argmax_us": us_of(lambda: row_argmax(x))}  # fmt: skip
        noise = torch.empty_like(x).exponential_(generator=g)
        softmax_pick = (torch.softmax(x, dim=-1) / noise).argmax(dim=-1)
        log_pick = row_argmax(x - noise.log())
        race = {"rows": rows, "same_token": int((softmax_pick == log_pick).sum()),
                "softmax_div_us": us_of(lambda: (torch.softmax(x, dim=-1) / torch.empty_like(x).exponential_()).argmax(dim=-1)),
                "log_sub_us": us_of(lambda: row_argmax(x - torch.empty_like(x).exponential_().log()))}  # fmt: skip
        print("RESULT", json.dumps(row), json.dumps(race), flush=True)
        result["argmax"].append(row)
        result["race"].append(race)
        (OUT / "sampler_check.json").write_text(json.dumps(result, indent=1))
    from step_breakdown import sampler_ms

    result["sampler_ms_per_step"] = sampler_ms(VOCAB)
    print("RESULT sampler", json.dumps(result["sampler_ms_per_step"]), flush=True)
    (OUT / "sampler_check.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
