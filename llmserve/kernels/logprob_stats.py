"""A sampled token's logprob and rank and each row's top-k logprobs, in one pass over the raw logits.

The tensor ops (log_softmax, then `(logprobs > token's).sum()` and `topk`) pass over the
batch's logits several times (timed by scripts/gpu/logprobs_micro.py). Here a program takes a block of a row of the model's logits (16-bit
or float32, read as float32, so the values are those of `logits.float()`). It writes its block's
max m and sum of exp(x - m) (the pieces of the row's log-sum-exp), counts the logits above the
sampled token's, and picks its block's k best (k rounds of max; the first column on ties). A few
small ops then make the row's log-sum-exp from its blocks' pieces, and a `topk` over the blocks'
candidates (k of each block) gives the row's k best, since they are among them. Logprobs are
logit - log-sum-exp, so a row's order is its logits' order: the rank and top ids are those of the
logits (equal to the log-softmax's but where float32 rounding makes two different logits' logprobs
equal), and the values agree with log_softmax's to float32 rounding (its sum runs in another
order). No log-softmax of the whole batch is written; only the rows that ask are read. Each of a
block's k rounds is a reduction: at k = 20 the rounds cost more than the tensor ops, so the
sampler takes this path up to k = 8 (`sampler.STATS_MAX_K`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch tuning, all of it
STATS_BLOCK = 2048  # vocabulary columns a program
STATS_WARPS = 8


@triton.jit
def _stats_kernel(x_ptr, rows_ptr, tok_ptr, count_ptr, max_ptr, sum_ptr, top_v_ptr, top_i_ptr, stride, vocab,
                  BLOCK: tl.constexpr, K: tl.constexpr, HAS_ROWS: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    b = tl.program_id(1)
    blocks = tl.num_programs(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    else:
        row = r.to(tl.int64)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    row_ptr = x_ptr + row * stride
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    token_x = tl.load(row_ptr + tl.load(tok_ptr + r)).to(tl.float32)
    at_block = r * blocks + b
    tl.store(count_ptr + at_block, tl.sum(((x > token_x) & mask).to(tl.int32), axis=0))
    m = tl.max(x, axis=0)
    total = tl.sum(tl.exp(x - m), axis=0)
    tl.store(max_ptr + at_block, m)
    tl.store(sum_ptr + at_block, tl.where(m == float("-inf"), 0.0, total))  # a block of -inf: nothing
    out = at_block * K
    for k in tl.static_range(K):
        best = tl.max(x, axis=0)
        at = tl.min(tl.where(x == best, cols, vocab - 1), axis=0)  # (a NaN block: a column all the same)
        tl.store(top_v_ptr + out + k, best)
        tl.store(top_i_ptr + out + k, at)
        x = tl.where(cols == at, float("-inf"), x)


def logprob_stats(logits: torch.Tensor, tokens: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """For the model's `logits` [B, V] (any float dtype, last dim contiguous), the rows `rows`
    (int64 [R]; None: all B) and their sampled `tokens` [R]: each row's token logprob (float32
    [R]), its rank (int64 [R], 1 + how many logits are larger) and its top `k` logprobs (values
    float32 [R, k] and ids int64 [R, k], best first); k >= 1."""
    assert logits.stride(-1) == 1 and k >= 1
    vocab = logits.shape[1]
    count = logits.shape[0] if rows is None else rows.shape[0]
    blocks = triton.cdiv(vocab, STATS_BLOCK)
    width = triton.next_power_of_2(k)
    device = logits.device
    counts = torch.empty(count, blocks, dtype=torch.int32, device=device)
    maxes = torch.empty(count, blocks, dtype=torch.float32, device=device)
    sums = torch.empty(count, blocks, dtype=torch.float32, device=device)
    top_v = torch.empty(count, blocks * width, dtype=torch.float32, device=device)
    top_i = torch.empty(count, blocks * width, dtype=torch.int32, device=device)
    _stats_kernel[(count, blocks)](logits, tokens if rows is None else rows, tokens, counts, maxes, sums, top_v, top_i,
                                   logits.stride(0), vocab, BLOCK=STATS_BLOCK, K=width, HAS_ROWS=rows is not None,
                                   num_warps=STATS_WARPS)  # fmt: skip
    peak = maxes.max(dim=-1, keepdim=True).values
    lse = peak + (sums * torch.exp(maxes - peak)).sum(dim=-1, keepdim=True).log()  # [R, 1]
    values, where = top_v.topk(min(k, blocks * width), dim=-1)
    token_x = (logits.gather(-1, tokens[:, None]) if rows is None else logits[rows, tokens][:, None]).float()
    return (token_x - lse).squeeze(-1), counts.sum(dim=-1) + 1, values - lse, top_i.gather(-1, where).to(torch.long)
