"""The exponential race over each row's top-p and min-p set, without sorting the vocabulary.

The reference (`sampler_reference.apply_top_k_top_p_min_p` then `exponential_race`) sorts every
row to find its nucleus: 512 rows of 128,256 logits took about 4 ms a decode step on an H100,
16 % of (a)'s step (docs/benchmarks.md). The race needs less than the nucleus: only its best
score. A row's kept set is every token at or above a threshold logit (top-p keeps a token when
the tokens strictly more likely hold at most top_p of the mass, ties kept together; min-p when
its probability is at least min_p times the largest), so:

1. one pass: the row's largest logit and its race winner c over every token;
2. a pass: the mass above c (and the row's softmax sum); if c is kept, it wins (no kept token
   scores higher, since none scores higher at all); if not, the threshold is above c, and the
   same pass has found the winner among the tokens above c that min-p keeps, the next c.

Each rejected c raises the floor, and a candidate is kept with probability at least top_p,
so a row takes about two passes, more only for a small top_p on a flat distribution; the
largest logit is always kept, so the loop ends. One program a row, every pass streaming it.

The noise is the one the sampler would draw: Philox inside the kernel for unseeded rows (keyed
by a seed drawn on the device: no host sync), and for a seeded row the hash of
`seeded_noise.exponential` at its (seed, position) keys, in the same 32-bit integer and float64
steps; seeded rows rank by `libdevice.log`, as torch's log, so they pick the reference's
tokens. `noise=` races with given Exp(1) noise instead (for tests, as `race`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FILTER_BLOCK = 2048  # vocabulary columns a step of a program's loop
_NONE = tl.constexpr(2147483647)  # "no candidate"
_MUL = tl.constexpr(0x45D9F3B)  # seeded_noise's multiplier and salt
_SALT = tl.constexpr(0x9E3779B9)


@triton.jit
def _h32(x):
    """seeded_noise._h32 on uint32 (its products modulo 2**32 are the int64 products masked)."""
    x = ((x >> 16) ^ x) * _MUL
    x = ((x >> 16) ^ x) * _MUL
    return (x >> 16) ^ x


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    """log as torch takes it: libdevice's on a GPU (`tl.log` may be an approximation there); the
    interpreter's `tl.log` is numpy's, and it has no libdevice."""
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _scores(row_ptr, noise_row, cols, vocab, temperature, seed, offset0, k0, k1, seeded,
            HAS_TEMP: tl.constexpr, HAS_NOISE: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
    """The columns' logits / T and race scores (logits / T - log E)."""
    mask = cols < vocab
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
    if HAS_TEMP:
        x = tl.div_rn(x, temperature)
    if HAS_NOISE:
        score = x - _log(tl.load(noise_row + cols, mask=mask, other=1.0), LIBDEVICE)
    elif seeded:
        ids = cols.to(tl.uint32)
        high = _h32(k0 ^ ids).to(tl.uint64)
        low = _h32(k1 ^ _h32(ids ^ _SALT)).to(tl.uint64)
        bits = (high << 21) | (low >> 11)
        uniform = (bits.to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
        score = x - _log((-_log(uniform, LIBDEVICE)).to(tl.float32), LIBDEVICE)
    else:
        score = x - tl.log(-tl.log(tl.rand(seed, offset0 + cols)))
    score = tl.where(mask & (score == score), score, float("-inf"))  # NaN never wins
    return x, score


@triton.jit
def _filtered_race_kernel(
    logits_ptr, rows_ptr, temp_ptr, top_p_ptr, min_p_ptr, slot_ptr, keys_ptr, noise_ptr, seed_ptr, out_ptr,
    stride_l, stride_n, vocab,
    BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_KEYS: tl.constexpr,
    HAS_NOISE: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = i.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    noise_row = noise_ptr + i.to(tl.int64) * stride_n
    temperature = 1.0
    if HAS_TEMP:
        temperature = tl.load(temp_ptr + i)
    top_p = tl.load(top_p_ptr + i)
    min_p = tl.load(min_p_ptr + i)
    seeded = False
    k0 = tl.zeros((), dtype=tl.uint32)
    k1 = tl.zeros((), dtype=tl.uint32)
    if HAS_KEYS:
        slot = tl.load(slot_ptr + i)
        seeded = slot >= 0
        if seeded:
            k0 = tl.load(keys_ptr + 2 * slot).to(tl.uint32)
            k1 = tl.load(keys_ptr + 2 * slot + 1).to(tl.uint32)
    seed = 0
    if not HAS_NOISE:
        seed = tl.load(seed_ptr)
    offset0 = i.to(tl.int64) * vocab
    lanes = tl.arange(0, BLOCK)

    # pass 1: the largest logit, and the race winner over every token
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_x = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.full([BLOCK], _NONE, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        x, score = _scores(row_ptr, noise_row, cols, vocab, temperature, seed, offset0, k0, k1, seeded,
                           HAS_TEMP, HAS_NOISE, LIBDEVICE)  # fmt: skip
        top = tl.maximum(top, tl.where(x == x, x, float("-inf")))
        better = score > best  # strictly: a lane keeps its first column on ties
        best = tl.where(better, score, best)
        best_x = tl.where(better, x, best_x)
        where = tl.where(better, cols, where)
    m = tl.max(top, axis=0)
    win = tl.max(best, axis=0)
    pick = tl.min(tl.where(best == win, where, _NONE), axis=0)  # the first column with the best score
    cand = pick
    cand_x = tl.max(tl.where(where == pick, best_x, float("-inf")), axis=0)
    done = ((cand == _NONE) | ((top_p >= 1.0) & (min_p <= 0.0))).to(tl.int32)  # no filter: the winner stands

    # then a pass a candidate: the mass above it decides; the winner above it is the next one
    while done == 0:
        above_mass = tl.zeros([BLOCK], dtype=tl.float32)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_x = tl.full([BLOCK], float("-inf"), tl.float32)
        where = tl.full([BLOCK], _NONE, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            x, score = _scores(row_ptr, noise_row, cols, vocab, temperature, seed, offset0, k0, k1, seeded,
                               HAS_TEMP, HAS_NOISE, LIBDEVICE)  # fmt: skip
            e = tl.exp(x - m)
            e = tl.where(x == x, e, 0.0)
            total += e
            above = x > cand_x
            above_mass += tl.where(above, e, 0.0)
            better = above & (e >= min_p) & (score > best)
            best = tl.where(better, score, best)
            best_x = tl.where(better, x, best_x)
            where = tl.where(better, cols, where)
        mass = tl.sum(above_mass, axis=0)
        z = tl.sum(total, axis=0)
        kept_p = (mass == 0.0) | (top_p >= 1.0) | (mass / z <= top_p)
        kept_min = (cand_x >= m) | (tl.exp(cand_x - m) >= min_p)
        win = tl.max(best, axis=0)
        pick = tl.min(tl.where(best == win, where, _NONE), axis=0)
        done = ((kept_p & kept_min) | (pick == _NONE)).to(tl.int32)  # (nothing above a rejected one: a broken row)
        if done == 0:
            cand = pick
            cand_x = tl.max(tl.where(where == pick, best_x, float("-inf")), axis=0)
    tl.store(out_ptr + i, tl.where(cand == _NONE, 0, cand).to(tl.int64))


def filtered_race(
    logits: torch.Tensor, rows: torch.Tensor | None, temperature: torch.Tensor | None, top_p: torch.Tensor,
    min_p: torch.Tensor, slots: torch.Tensor | None = None, keys: torch.Tensor | None = None,
    noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
) -> torch.Tensor:  # fmt: skip
    """The race winners (int64 [R]) of rows `rows` (int64 [R], or None: every row) of `logits`
    [B, V] (float32, last dim contiguous) divided by `temperature` (float32 [R] or None: 1), over
    each row's top-p (`top_p`, float32 [R]) and min-p (`min_p`, float32 [R]) set. `slots` (int32 [R]):
    each row's index into `keys` (int64 [S, 2], `seeded_noise.row_key`), -1 for an unseeded row
    (None: no seeded row). `noise` ([R, V] float32 Exp(1)): race with it instead (for tests)."""
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    n = logits.shape[0] if rows is None else rows.numel()
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n == 0:
        return out
    seed = None
    if noise is None:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=logits.device, generator=generator)
    else:
        assert noise.shape == (n, logits.shape[-1]) and noise.stride(-1) == 1
    has_keys = slots is not None and keys is not None and keys.numel() > 0
    _filtered_race_kernel[(n,)](
        logits, rows if rows is not None else logits, temperature if temperature is not None else logits,
        top_p, min_p, slots if has_keys else logits, keys.contiguous() if has_keys else logits,
        noise if noise is not None else logits, seed if seed is not None else logits, out,
        logits.stride(0), noise.stride(0) if noise is not None else 0, logits.shape[-1],
        BLOCK=FILTER_BLOCK, HAS_ROWS=rows is not None, HAS_TEMP=temperature is not None, HAS_KEYS=has_keys,
        HAS_NOISE=noise is not None, LIBDEVICE=logits.is_cuda, num_warps=8,
    )  # fmt: skip
    return out
