"""The exponential race over each row's top-p and min-p set, without sorting the vocabulary.

The reference (`sampler_reference.apply_top_k_top_p_min_p` then `exponential_race`) sorts every
row to find its nucleus, a sort of every row's whole vocabulary each step (what it cost:
docs/history/benchmarks.md). The race needs less than the nucleus: only its best
score. A row's kept set is every token at or above a threshold logit (top-p keeps a token when
the tokens strictly more likely hold at most top_p of the mass, ties kept together; min-p when
its probability is at least min_p times the largest), so:

1. a pass: the row's largest logit m and its race winner c over every token;
2. c is kept by min-p if exp(c - m) >= min_p, and by top-p if a pass finds the mass above it
   at most top_p (a pass of exp alone, no noise); a kept c wins (no kept token scores higher,
   since none scores higher at all);
3. if not, the threshold is above c: a pass races the tokens above c that min-p keeps, and
   its winner is the next c.

A candidate is kept with probability at least top_p, so a row mostly takes two passes (one
with noise), more only for a small top_p on a flat distribution; the largest logit is always
kept, so the loop ends. One program a row, every pass streaming it.

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

# Launch tuning, all of it (one program a row)
FILTER_BLOCK = 2048  # vocabulary columns a step of a program's loop
FILTER_WARPS = 8

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
def _logits(row_ptr, cols, vocab, temperature, HAS_TEMP: tl.constexpr):
    x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
    if HAS_TEMP:
        x = tl.div_rn(x, temperature)
    return x


@triton.jit
def _score(x, cols, vocab, noise_row, u, k0, k1, seeded, HAS_NOISE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The columns' race scores: logits / T - log E."""
    mask = cols < vocab
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
        score = x - tl.log(-tl.log(u))
    return tl.where(mask & (score == score), score, float("-inf"))  # NaN never wins


@triton.jit
def _race_part(row_ptr, noise_row, cols, vocab, temperature, u, k0, k1, seeded, floor, m, min_p,
               top, best, best_x, where,
               HAS_TEMP: tl.constexpr, HAS_NOISE: tl.constexpr, LIBDEVICE: tl.constexpr, FILTER: tl.constexpr):  # fmt: skip
    """A quarter of a step's columns into the running maximum and the running winner (with
    FILTER: among the tokens above `floor` that min-p keeps)."""
    x = _logits(row_ptr, cols, vocab, temperature, HAS_TEMP)
    score = _score(x, cols, vocab, noise_row, u, k0, k1, seeded, HAS_NOISE, LIBDEVICE)
    top = tl.maximum(top, tl.where(x == x, x, float("-inf")))
    better = score > best  # strictly: a lane keeps its first column on ties
    if FILTER:
        better = better & (x > floor) & (tl.exp(x - m) >= min_p)
    return top, tl.where(better, score, best), tl.where(better, x, best_x), tl.where(better, cols, where)


@triton.jit
def _race_pass(row_ptr, noise_row, vocab, temperature, seed, offset0, k0, k1, seeded, floor, m, min_p,
               BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_NOISE: tl.constexpr, LIBDEVICE: tl.constexpr,
               FILTER: tl.constexpr):  # fmt: skip
    """One pass over the row: its largest logit, and the race winner (column, logit / T) over
    every token, or with FILTER over the tokens above `floor` that min-p keeps. Unseeded rows
    draw four uniforms a Philox call (offsets unique to row, step and lane)."""
    quarter: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, quarter)
    top = tl.full([quarter], float("-inf"), tl.float32)
    best = tl.full([quarter], float("-inf"), tl.float32)
    best_x = tl.full([quarter], float("-inf"), tl.float32)
    where = tl.full([quarter], _NONE, tl.int32)
    for start in range(0, vocab, BLOCK):
        u0 = tl.zeros([quarter], dtype=tl.float32)
        u1 = u0
        u2 = u0
        u3 = u0
        if not HAS_NOISE:
            if not seeded:
                u0, u1, u2, u3 = tl.rand4x(seed, offset0 + start // 4 + lanes)
        cols = start + lanes
        top, best, best_x, where = _race_part(row_ptr, noise_row, cols, vocab, temperature, u0, k0, k1, seeded, floor,
                                              m, min_p, top, best, best_x, where, HAS_TEMP, HAS_NOISE, LIBDEVICE, FILTER)  # fmt: skip
        top, best, best_x, where = _race_part(row_ptr, noise_row, cols + quarter, vocab, temperature, u1, k0, k1, seeded,
                                              floor, m, min_p, top, best, best_x, where, HAS_TEMP, HAS_NOISE, LIBDEVICE,
                                              FILTER)  # fmt: skip
        top, best, best_x, where = _race_part(row_ptr, noise_row, cols + 2 * quarter, vocab, temperature, u2, k0, k1,
                                              seeded, floor, m, min_p, top, best, best_x, where, HAS_TEMP, HAS_NOISE,
                                              LIBDEVICE, FILTER)  # fmt: skip
        top, best, best_x, where = _race_part(row_ptr, noise_row, cols + 3 * quarter, vocab, temperature, u3, k0, k1,
                                              seeded, floor, m, min_p, top, best, best_x, where, HAS_TEMP, HAS_NOISE,
                                              LIBDEVICE, FILTER)  # fmt: skip
    win = tl.max(best, axis=0)
    pick = tl.min(tl.where(best == win, where, _NONE), axis=0)  # the first column with the best score
    return tl.max(top, axis=0), pick, tl.max(tl.where(where == pick, best_x, float("-inf")), axis=0)


@triton.jit
def _mass_pass(row_ptr, vocab, temperature, m, floor, BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr):
    """The softmax mass (unnormalised: exp(x - m)) above `floor`, and the row's whole."""
    lanes = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK], dtype=tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        x = _logits(row_ptr, start + lanes, vocab, temperature, HAS_TEMP)
        e = tl.exp(x - m)
        e = tl.where(x == x, e, 0.0)
        total += e
        above += tl.where(x > floor, e, 0.0)
    return tl.sum(above, axis=0), tl.sum(total, axis=0)


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
    offset0 = i.to(tl.int64) * tl.cdiv(vocab, BLOCK) * (BLOCK // 4)

    # the largest logit, and the race winner over every token
    m, cand, cand_x = _race_pass(row_ptr, noise_row, vocab, temperature, seed, offset0, k0, k1, seeded,
                                 float("-inf"), 0.0, 0.0, BLOCK, HAS_TEMP, HAS_NOISE, LIBDEVICE, False)  # fmt: skip
    done = ((cand == _NONE) | ((top_p >= 1.0) & (min_p <= 0.0))).to(tl.int32)  # no filter: the winner stands
    while done == 0:
        # kept by min-p (its logit alone decides), then by top-p (a pass: the mass above it)
        kept = ((cand_x >= m) | (tl.exp(cand_x - m) >= min_p)).to(tl.int32)
        if (kept != 0) & (top_p < 1.0):
            mass, z = _mass_pass(row_ptr, vocab, temperature, m, cand_x, BLOCK, HAS_TEMP)
            kept = ((mass == 0.0) | (mass / z <= top_p)).to(tl.int32)
        none_above = tl.zeros((), dtype=tl.int32)
        if kept == 0:  # the threshold is above it: the next candidate is the winner above it
            _, after, after_x = _race_pass(row_ptr, noise_row, vocab, temperature, seed, offset0, k0, k1, seeded,
                                           cand_x, m, min_p, BLOCK, HAS_TEMP, HAS_NOISE, LIBDEVICE, True)  # fmt: skip
            none_above = (after == _NONE).to(tl.int32)  # (only in a broken row)
            if none_above == 0:
                cand = after
                cand_x = after_x
        done = kept | none_above
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
        HAS_NOISE=noise is not None, LIBDEVICE=logits.is_cuda, num_warps=FILTER_WARPS,
    )  # fmt: skip
    return out
