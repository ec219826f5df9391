"""The sampler's two passes over the vocabulary, in Triton: penalties, and the exponential race.

A batch of 512 rows of 128,256 float32 logits is 263 MB; the sampler's tensor ops read and
write it once per op. With a presence penalty and a temperature that was about a dozen
passes (gather the rows, gather the counts, compare, convert, multiply, add, subtract,
scatter back; divide, draw noise, take its log, subtract, argmax), ten times greedy's time
(docs/history/benchmarks.md). Here each is one pass:

- `apply_penalties_`: repetition, presence and frequency penalties on the penalised rows of
  float32 logits, in place, from the device-side counts of `PenaltyState`. Reference:
  `PenaltyState.apply_tensors` (the batched tensor ops; and, one request at a time,
  `sampler_reference.apply_penalties`). The same float32 operations in the same order, with
  correctly rounded division and no fused multiply-add, so the result is bit-identical.
- `race`: each row's winner of the exponential race (argmax of logits / T - log E, E ~ Exp(1))
  for rows without top-k, top-p, min-p or a seed. The noise is drawn inside the kernel
  (Philox, keyed by a seed drawn from torch's generator on the device: no host sync, and the
  engine's `seed` still fixes the stream); each program writes its block's best score and
  position, and a small argmax over the blocks picks the row's winner (the first position on
  ties, as `torch.argmax`; NaN scores count as -inf, so a broken row still gives a token of the
  vocabulary). Reference: `sampler_reference.exponential_race(logits / T, E)`; given the same E
  (`noise=`) the kernel picks the same tokens under the interpreter. On a GPU `tl.log` is an
  approximation, so a near-tie may go the other way (tests/gpu/test_gpu_sampler.py checks the tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch tuning, all of it
PENALTY_BLOCK = 2048  # vocabulary columns a program
PENALTY_WARPS = 4
RACE_BLOCK = 4096  # columns a program in the race (four draws of Philox each: BLOCK / 4 calls)
RACE_WARPS = 8


@triton.jit
def _penalties_kernel(
    logits_ptr, counts_ptr, seen_ptr, rows_ptr, slots_ptr, rep_ptr, presence_ptr, frequency_ptr,
    stride_l, stride_c, stride_s, vocab,
    BLOCK: tl.constexpr, HAS_REP: tl.constexpr, HAS_SEEN: tl.constexpr, HAS_ADD: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0)
    counts = tl.load(counts_ptr + slot * stride_c + cols, mask=mask, other=0)
    used = counts > 0
    if HAS_REP:
        rep = tl.load(rep_ptr + i)
        seen = used
        if HAS_SEEN:
            seen = seen | (tl.load(seen_ptr + slot * stride_s + cols, mask=mask, other=0) != 0)
        x = tl.where(seen, tl.where(x > 0, tl.div_rn(x, rep), x * rep), x)
    if HAS_ADD:
        presence = tl.load(presence_ptr + i)
        frequency = tl.load(frequency_ptr + i)
        x = x - (frequency * counts.to(tl.float32) + presence * used.to(tl.float32))
    tl.store(logits_ptr + row * stride_l + cols, x, mask=mask)


def apply_penalties_(
    logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor | None, rows: torch.Tensor,
    slots: torch.Tensor, repetition: torch.Tensor | None, presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Penalise rows `rows` of `logits` [B, V] (float32, last dim contiguous) in place, from
    `counts[slots]` (int32 [S, V], output token counts) and `prompt_seen[slots]` (bool [S, V] or
    None). `repetition` (float32 [R], or None: no repetition penalty in the batch), `presence`
    and `frequency` (float32 [R] both, or both None). Returns `logits`."""
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1 and counts.stride(-1) == 1
    n, vocab = rows.numel(), logits.shape[-1]
    if n == 0 or (repetition is None and presence is None):
        return logits
    has_seen = repetition is not None and prompt_seen is not None
    seen = prompt_seen.view(torch.uint8) if has_seen else counts
    grid = (n, triton.cdiv(vocab, PENALTY_BLOCK))
    _penalties_kernel[grid](
        logits, counts, seen, rows, slots,
        repetition if repetition is not None else logits,
        presence if presence is not None else logits,
        frequency if frequency is not None else logits,
        logits.stride(0), counts.stride(0), seen.stride(0), vocab,
        BLOCK=PENALTY_BLOCK, HAS_REP=repetition is not None, HAS_SEEN=has_seen, HAS_ADD=presence is not None,
        num_warps=PENALTY_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return logits


@triton.jit
def _race_part(row_ptr, cols, vocab, temperature, u, noise_row, HAS_TEMP: tl.constexpr, HAS_NOISE: tl.constexpr):
    """One quarter of a program's columns: their scores' best value and its column."""
    mask = cols < vocab
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
    if HAS_TEMP:
        x = tl.div_rn(x, temperature)
    if HAS_NOISE:
        e = tl.load(noise_row + cols, mask=mask, other=1.0)
    else:
        e = -tl.log(u)
    score = x - tl.log(e)
    score = tl.where(mask & (score == score), score, float("-inf"))  # NaN (a broken row) never wins: a valid column
    best = tl.max(score, axis=0)
    where = tl.min(tl.where(score == best, cols, 2147483647), axis=0)  # the first column holding it
    return best, where


@triton.jit
def _race_kernel(
    logits_ptr, rows_ptr, temp_ptr, noise_ptr, seed_ptr, best_ptr, where_ptr, stride_l, stride_n, vocab,
    BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_NOISE: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    b = tl.program_id(1)
    n_blocks = tl.num_programs(1)
    row = i
    if HAS_ROWS:
        row = tl.load(rows_ptr + i)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    noise_row = noise_ptr + i.to(tl.int64) * stride_n
    temperature = 1.0
    if HAS_TEMP:
        temperature = tl.load(temp_ptr + i)
    quarter: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, quarter)
    cols = b * BLOCK + lanes
    u0 = tl.zeros([quarter], dtype=tl.float32)
    u1 = u0
    u2 = u0
    u3 = u0
    if not HAS_NOISE:  # four uniforms a Philox call; offsets unique to (row, block, lane)
        seed = tl.load(seed_ptr)
        offsets = (i.to(tl.int64) * n_blocks + b) * quarter + lanes
        u0, u1, u2, u3 = tl.rand4x(seed, offsets)
    best, where = _race_part(row_ptr, cols, vocab, temperature, u0, noise_row, HAS_TEMP, HAS_NOISE)
    v, w = _race_part(row_ptr, cols + quarter, vocab, temperature, u1, noise_row, HAS_TEMP, HAS_NOISE)
    where = tl.where(v > best, w, where)  # a later part wins only when strictly better: first on ties
    best = tl.maximum(best, v)
    v, w = _race_part(row_ptr, cols + 2 * quarter, vocab, temperature, u2, noise_row, HAS_TEMP, HAS_NOISE)
    where = tl.where(v > best, w, where)
    best = tl.maximum(best, v)
    v, w = _race_part(row_ptr, cols + 3 * quarter, vocab, temperature, u3, noise_row, HAS_TEMP, HAS_NOISE)
    where = tl.where(v > best, w, where)
    best = tl.maximum(best, v)
    tl.store(best_ptr + i * n_blocks + b, best)
    tl.store(where_ptr + i * n_blocks + b, where)


def race(
    logits: torch.Tensor, rows: torch.Tensor | None, temperature: torch.Tensor | None,
    noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
) -> torch.Tensor:  # fmt: skip
    """The exponential race's winners (int64 [R]) of rows `rows` (int64 [R], or None: every row)
    of `logits` [B, V] (float32, last dim contiguous), divided by `temperature` (float32 [R], or
    None: 1). `noise` ([R, V] float32 Exp(1)): race with it, as the reference does (for tests);
    None: Philox noise from a seed drawn from `generator` (torch's default one: None) on the device."""
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    n = logits.shape[0] if rows is None else rows.numel()
    vocab = logits.shape[-1]
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    blocks = triton.cdiv(vocab, RACE_BLOCK)
    best = torch.empty(n, blocks, dtype=torch.float32, device=logits.device)
    where = torch.empty(n, blocks, dtype=torch.int32, device=logits.device)
    seed = None
    if noise is None:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=logits.device, generator=generator)
    else:
        assert noise.shape == (n, vocab) and noise.stride(-1) == 1
    _race_kernel[(n, blocks)](
        logits, rows if rows is not None else logits, temperature if temperature is not None else logits,
        noise if noise is not None else logits, seed if seed is not None else logits, best, where,
        logits.stride(0), noise.stride(0) if noise is not None else 0, vocab,
        BLOCK=RACE_BLOCK, HAS_ROWS=rows is not None, HAS_TEMP=temperature is not None, HAS_NOISE=noise is not None,
        num_warps=RACE_WARPS,
    )  # fmt: skip
    block = best.argmax(dim=-1, keepdim=True)  # the first block with the best score: the first column
    return where.gather(-1, block).squeeze(-1).to(torch.long)
