"""The sampled token's rank and each row's top-k logprobs, in one pass over the vocabulary.

The tensor ops (`(logprobs > token's).sum()` and `topk`) took 0.59 and 0.90 ms for 512 rows of
128,256 on an H100 (scripts/gpu/logprobs_micro.py), with log_softmax 0.37: (a) with top-5
logprobs ran 6 % below greedy. Here a program takes a block of a row: it counts the logprobs
above the sampled token's and picks its block's k best (k rounds of max; the first column on
ties); a `topk` over the blocks' candidates (k of each block) then gives the row's k best,
since they are among them. The values are the logprobs themselves, so ranks and values equal
the tensor ops'; `torch.topk` orders tied values its own way, as the reference's does. Each of
a block's k rounds is a reduction: 0.40 ms at k = 5 (8 rounds), 1.97 at k = 20 (32), so the
sampler takes this path up to k = 8 (`sampler.STATS_MAX_K`) and the tensor ops beyond.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STATS_BLOCK = 2048


@triton.jit
def _stats_kernel(lp_ptr, tok_ptr, count_ptr, top_v_ptr, top_i_ptr, stride, vocab,
                  BLOCK: tl.constexpr, K: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    b = tl.program_id(1)
    blocks = tl.num_programs(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    row_ptr = lp_ptr + r.to(tl.int64) * stride
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
    token_lp = tl.load(row_ptr + tl.load(tok_ptr + r))
    tl.store(count_ptr + r * blocks + b, tl.sum(((x > token_lp) & mask).to(tl.int32), axis=0))
    out = (r * blocks + b) * K
    for k in tl.static_range(K):
        best = tl.max(x, axis=0)
        at = tl.min(tl.where(x == best, cols, vocab - 1), axis=0)  # (a NaN block: a column all the same)
        tl.store(top_v_ptr + out + k, best)
        tl.store(top_i_ptr + out + k, at)
        x = tl.where(cols == at, float("-inf"), x)


def logprob_stats(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `logprobs` [R, V] (float32, last dim contiguous) and the sampled `tokens` [R]: each row's
    rank of its token (int64 [R], 1 + how many logprobs are larger) and its top `k` (values float32
    [R, k] and ids int64 [R, k], best first); k >= 1."""
    assert logprobs.dtype == torch.float32 and logprobs.stride(-1) == 1 and k >= 1
    rows, vocab = logprobs.shape
    blocks = triton.cdiv(vocab, STATS_BLOCK)
    width = triton.next_power_of_2(k)
    counts = torch.empty(rows, blocks, dtype=torch.int32, device=logprobs.device)
    top_v = torch.empty(rows, blocks * width, dtype=torch.float32, device=logprobs.device)
    top_i = torch.empty(rows, blocks * width, dtype=torch.int32, device=logprobs.device)
    _stats_kernel[(rows, blocks)](logprobs, tokens, counts, top_v, top_i, logprobs.stride(0), vocab,
                                  BLOCK=STATS_BLOCK, K=width, num_warps=8)  # fmt: skip
    values, where = top_v.topk(min(k, blocks * width), dim=-1)
    return counts.sum(dim=-1) + 1, values, top_i.gather(-1, where).to(torch.long)
