"""What a decode step's logprobs cost on the GPU, by op, and the one-pass kernel against them:

    python3 scripts/gpu/logprobs_micro.py

512 rows x 128,256 (bf16-rounded logits, as the model gives): log_softmax, the sampled token's
gather, its rank by `(lp > token's).sum()`, `topk(5)` (on logprobs and on raw logits), and
`logprob_stats` (llmserve/kernels/logprob_stats.py: rank and top 5 in one pass) with its
ranks, values and ids against the tensor ops' (must be equal). CUDA events, median of 20.
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
x = (torch.randn(B, V, device=dev) * 2).to(torch.bfloat16).float()
tok = torch.randint(0, V, (B,), device=dev)
lp = torch.log_softmax(x, -1)
token_lp = lp.gather(-1, tok[:, None])
rank, values, ids = logprob_stats(lp, tok, 5)
want_v, want_i = lp.topk(5, dim=-1)
res = {
    "equal_rank": bool(torch.equal(rank, (lp > token_lp).sum(-1) + 1)),
    "equal_values": bool(torch.equal(values, want_v)), "equal_ids_rows": int((ids == want_i).all(-1).sum().item()),
    "log_softmax": median_ms(lambda: torch.log_softmax(x, -1), 20, 3),
    "gather": median_ms(lambda: lp.gather(-1, tok[:, None]), 20, 3),
    "rank_sum": median_ms(lambda: (lp > token_lp).sum(-1), 20, 3),
    "topk5_lp": median_ms(lambda: lp.topk(5, dim=-1), 20, 3),
    "topk5_raw": median_ms(lambda: x.topk(5, dim=-1), 20, 3),
    "logprob_stats_k5": median_ms(lambda: logprob_stats(lp, tok, 5), 20, 3),
    "logprob_stats_k20": median_ms(lambda: logprob_stats(lp, tok, 20), 20, 3),
}  # fmt: skip
print("RESULT", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
