"""Causal attention of fresh prompts (no cached prefix) over their own keys and values, in Triton.

PyTorch reference: causal `scaled_dot_product_attention` of each prompt's q `[n, Hq, D]` over its
k/v `[n, Hkv, D]` (what `paged_attention.sdpa_prefill` computes, and what the paged kernel gives for
a sequence whose every token is new).

The paged kernel reads keys and values through the block table, and packs a GQA group's heads
into the rows of its tiles. This kernel reads them from the step's own contiguous k/v (strided views
of the fused projection are fine), one query head per program, FlashAttention-2 style: 1.4-1.6x
the paged kernel's speed for steps of 512- to 2,048-token prompts (scripts/gpu/fresh_prefill_micro.py;
docs/history/benchmarks.md, "Fresh prompts of 512-2,047 tokens by their own kernel"). The K/V of
these prompts still go to the cache, written by the caller as before.

Grid `(tiles of the longest prompt, prompts, query heads)`. Program (t, s, h) takes BLOCK_M queries
of prompt s, counting the tiles from the prompt's end, so each prompt's tiles with the most keys
start first.
A program whose tile lies past its prompt's end exits at once. The keys below the tile's first
query need no mask, and the tile's own diagonal blocks are masked. The softmax is online, in
fp32, with exp2.

A sliding `window` (the query at p sees keys in (p - window, p]; a compile-time SLIDING variant,
the window itself a runtime number) starts a tile's keys at the block of its first query's first
key; keys before the last query's window start are masked too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import lru_cache

import torch
import triton
import triton.language as tl

from llmserve.host_copy import to_device

LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, warps, stages) by the longest prompt, the best of the sweep above (bf16, 32/8
# heads, D 128): 32 x 512 at 64 x 32 / 4 / 2, 16 x 1,024 at 64 x 64 / 4 / 3 (128 x 64 / 8 warps
# 5 % slower), 8 x 2,048 and 4 x 1,536 at 128 x 64 / 8 / 3
_SHORT, _MEDIUM, _LONG = (64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3)


# Shared memory a program's tiles take (the Q tile, and a K and a V tile per pipeline stage) is kept
# under this: an A100 gives a block 163 KiB, Hopper 227 KiB, and the compiler adds its own buffers.
# D 128 in 16 bits is never cut (128 KiB at most); D 256 is: (128, 64, 8, 3) would ask for 256 KiB.
SMEM_BUDGET = 144 * 1024


def tile_bytes(config: tuple[int, int, int, int], head_dim: int, itemsize: int) -> int:
    block_m, block_n, _, stages = config
    return itemsize * head_dim * (block_m + 2 * stages * block_n)


def launch_config(longest: int, head_dim: int = 128, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) by the longest prompt, cut to the shared-memory budget for
    wider heads or 32-bit tokens: fewer stages first, then narrower key tiles, then fewer rows."""
    block_m, block_n, warps, stages = _SHORT if longest < 768 else _MEDIUM if longest < 1536 else _LONG
    while tile_bytes((block_m, block_n, warps, stages), head_dim, itemsize) > SMEM_BUDGET:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > 16:
            block_m, warps = block_m // 2, 4
        else:
            break
    return block_m, block_n, warps, stages


@triton.jit
def _attend_keys(
    acc, l_i, m_i, q, k_base, v_base, lo, hi, n, window, offs_m, offs_n, offs_d, stride_kt, stride_vt, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Online-softmax accumulation over the prompt's keys [lo, hi) (as `paged_attention._attend_range`,
    with the keys read from the prompt's own rows). MASKED=False: every key in range is visible to
    every row; True: the causal mask (with SLIDING, keys in (row - window, row] only), and no key at
    or past the prompt's `n` tokens."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        if MASKED:
            k = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=cols[None, :] < n, other=0.0)
        else:
            k = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None])
        s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
        if MASKED:
            s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
            if SLIDING:
                s = tl.where(offs_m[:, None] - cols[None, :] < window, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED and SLIDING:  # a row with no key in its window yet keeps m = -inf: subtract 0 (no NaN)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=cols[:, None] < n, other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_tiles", "window"])  # (one compiled variant per tile shape, whatever the count)
def _fresh_prefill_kernel(
    Q, K, V, O, SEQS,  # SEQS: int32 [num_prompts, 2]: first row in the batch, tokens
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, qk_scale,
    num_tiles, window, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(1)
    head = tl.program_id(2)
    first = tl.load(SEQS + seq * 2)
    n = tl.load(SEQS + seq * 2 + 1)
    m0 = (num_tiles - 1 - tl.program_id(0)) * BLOCK_M  # the last tiles (most keys) first
    if m0 >= n:
        return
    kvh = head // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (first + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=offs_m[:, None] < n, other=0.0)  # fmt: skip
    k_base = K + first * stride_kt + kvh * stride_kh
    v_base = V + first * stride_vt + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys below the tile's first query are all visible; the tile's own diagonal is causal
    free = 0
    if SLIDING:  # in a window: from the block of the first row's first key, masked up to the last row's
        lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        free = tl.minimum(tl.cdiv(tl.maximum(m0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, m0)
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k_base, v_base, lo, free, n, window, offs_m, offs_n, offs_d,
                                     stride_kt, stride_vt, qk_scale, BLOCK_N, True, SLIDING, DOT_PREC)  # fmt: skip
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k_base, v_base, free, m0, n, window, offs_m, offs_n, offs_d,
                                 stride_kt, stride_vt, qk_scale, BLOCK_N, False, SLIDING, DOT_PREC)  # fmt: skip
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k_base, v_base, m0, tl.minimum(m0 + BLOCK_M, n), n, window,
                                 offs_m, offs_n, offs_d, stride_kt, stride_vt, qk_scale, BLOCK_N, True, SLIDING,
                                 DOT_PREC)  # fmt: skip
    if SLIDING:  # a padding row past the prompt's end may see no key in its window
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    tl.store(O + (first + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=offs_m[:, None] < n)  # fmt: skip


@lru_cache(maxsize=8)
def _seqs_on_device(seqs: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """The prompts' (first row, tokens) on the device, made once for a step's layers (the same
    tuple each layer) and copied without a stream sync."""
    return to_device([x for pair in seqs for x in pair], torch.int32, device).view(-1, 2)


def fresh_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: tuple[tuple[int, int], ...], scale: float,
    out: torch.Tensor, config: tuple[int, int, int, int] | None = None, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Write into `out` the causal attention of each fresh prompt (first row, tokens) in `seqs` over
    its own rows of q `[T, Hq, D]`, k and v `[T, Hkv, D]` (last dimension contiguous). The other
    rows of `out` are left untouched. `config` (BLOCK_M, BLOCK_N, warps, stages) forces the tiles
    (sweeps); None: `launch_config`. A sliding `window`: the query at p sees keys in (p - window, p]."""
    assert window is None or window >= 1, window
    if not seqs:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert head_dim == triton.next_power_of_2(head_dim) and q.shape[1] % k.shape[1] == 0
    longest = max(n for _, n in seqs)
    block_m, block_n, warps, stages = config or launch_config(longest, head_dim, q.element_size())
    num_tiles = triton.cdiv(longest, block_m)
    _fresh_prefill_kernel[(num_tiles, len(seqs), num_heads)](
        q, k, v, out, _seqs_on_device(tuple(seqs), q.device),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * LOG2E, num_tiles, window or 0, GROUP=num_heads // k.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", SLIDING=window is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def warmup_fresh_prefill(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         device: torch.device, submit: Callable[[Callable[[], object]], object] | None = None,
                         window: int | None = None) -> int:  # fmt: skip
    """Compile the kernel for each tile shape `launch_config` picks, on q/k/v laid out as the model
    has them (views of one fused projection); each launch handed to `submit` (None: run at once).
    A `window`: the sliding-window variants. Returns how many (0: a head size it does not take)."""
    if head_dim != triton.next_power_of_2(head_dim):
        return 0
    # one length of each config's range; where wide heads cut two ranges to one shape, it once
    by_config = {launch_config(n, head_dim, dtype.itemsize): n for n in (1600, 1100, 600)}
    lengths = sorted(by_config.values())

    def launch(n: int) -> None:
        qkv = torch.zeros(n, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
        q, k, v = (t.view(n, -1, head_dim) for t in qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                                                                num_kv_heads * head_dim], -1))  # fmt: skip
        fresh_prefill_attention(q, k, v, ((0, n),), head_dim**-0.5, torch.empty_like(q), window=window)

    for n in lengths:
        (submit or (lambda unit: unit()))(functools.partial(launch, n))
    return len(lengths)


__all__ = ["fresh_prefill_attention", "launch_config", "warmup_fresh_prefill"]
