"""What a decode step's logprobs cost on the GPU, by op, and the one-pass kernel against them:

    python3 scripts/gpu/logprobs_micro.py

512 rows x 128,256 bf16 logits (as the model gives): the tensor ops (`logits.float()`,
log_softmax, the sampled token's gather, its rank by `(lp > token's).sum()`, `topk(5)`) and
`logprob_stats` (llmserve/kernels/logprob_stats.py: from the bf16 logits, token logprob, rank
and top 5 in one pass) on every row and on one row in five, with its ranks and ids against the
tensor ops' (must be equal) and its values' largest difference. CUDA events, median of 20.
Prints a RESULT line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from event_timer import median_ms  # noqa: E402

from llmserve.kernels.logprob_stats import logprob_stats  # noqa: E402

dev = torch.device("cuda")
B, V = 512, 128256
x = (torch.randn(B, V, device=dev) * 2).to(torch.bfloat16)
tok = torch.randint(0, V, (B,), device=dev)
fifth = torch.arange(0, B, 5, device=dev)


def tensor_ops(rows=None):
    lp = torch.log_softmax(x.float(), -1)
    part, picked = (lp, tok) if rows is None else (lp[rows], tok[rows])
    token_lp = part.gather(-1, picked[:, None])
    return token_lp.squeeze(-1), (part > token_lp).sum(-1) + 1, *part.topk(5, dim=-1)


res = {}
for name, rows in (("all", None), ("fifth", fifth)):
    want = tensor_ops(rows)
    got = logprob_stats(x, tok if rows is None else tok[rows], 5, rows)
    res[f"equal_rank_{name}"] = bool(torch.equal(got[1], want[1]))
    res[f"equal_ids_rows_{name}"] = int((got[3] == want[3]).all(-1).sum().item())
    res[f"rows_{name}"] = int(got[0].shape[0])
    res[f"max_diff_values_{name}"] = max(float((got[0] - want[0]).abs().max()), float((got[2] - want[2]).abs().max()))
    res[f"tensor_ops_{name}"] = median_ms(lambda: tensor_ops(rows), 20, 3)
    picked = tok if rows is None else tok[rows]
    res[f"logprob_stats_k5_{name}"] = median_ms(lambda: logprob_stats(x, picked, 5, rows), 20, 3)
lp = torch.log_softmax(x.float(), -1)
res.update({
    "float": median_ms(lambda: x.float(), 20, 3),
    "log_softmax": median_ms(lambda: torch.log_softmax(lp, -1), 20, 3),
    "topk5_lp": median_ms(lambda: lp.topk(5, dim=-1), 20, 3),
    "logprob_stats_k8_all": median_ms(lambda: logprob_stats(x, tok, 8), 20, 3),
    "logprob_stats_k20_all": median_ms(lambda: logprob_stats(x, tok, 20), 20, 3),
})  # fmt: skip
print("RESULT", json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
